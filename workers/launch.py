"""What the prefill and decode entrypoints share: flags, process group, identity, publication.

Exit codes of both entrypoints (every rank of a group exits with the same one when the cause
is group-wide, because the outcome is agreed on collectively):

    0  done, every byte verified        3  the registry refused the agents' registration
    1  unexpected error                 4  superseded by a newer launch while serving
    2  the engine_id cross-verify failed  5  nothing verified: a transfer or verification
                                          failed, or the handshake was refused
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from registry_client.client import RegistryClient
from registry_client.errors import EngineIdentityError, EngineIdMismatch
from registry_client.models import AgentItem, KvSpec, Role
from workers.endpoint import (
    NixlEndpoint,
    advertise_host,
    check_host_for_group,
    stop_on_signals,
)
from workers.identity import (
    EngineIdentity,
    agree,
    cpu_group_for,
    local_engine_id,
    sync_engine_id,
)
from workers.kv import KvLayout
from workers.node import RankPublication, publish_per_node
from workers.publication import LocalFailure, Publication, verdict_of
from workers.settings import WorkerSettings

EXIT_OK, EXIT_ERROR, EXIT_IDENTITY, EXIT_REFUSED, EXIT_SUPERSEDED, EXIT_TRANSFER = range(6)

log = logging.getLogger("workers")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    node_rank: int
    hostname: str
    # CPU (gloo) group over the world, for object collectives (see identity's module doc).
    cpu_group: Any = None


def init_distributed(args: WorkerSettings) -> RankInfo:
    """Join the TP group torchrun set up (gloo on CPU, nccl when the KV lives on GPUs)."""
    backend = "nccl" if str(args.device).startswith("cuda") else "gloo"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=args.collective_timeout_s))
    info = RankInfo(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
        hostname=socket.gethostname(),
        cpu_group=cpu_group_for(None),
    )
    return info


def setup_logging(role: str, info: RankInfo, group_id: str) -> None:
    fmt = (
        f"%(asctime)s [{role} {group_id} rank {info.rank}/{info.world} "
        f"node {info.node_rank}] %(levelname)s %(message)s"
    )
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


class Reporter:
    """One JSON file per rank, rewritten atomically as the rank makes progress."""

    def __init__(self, report_dir: str | None, role: str, group_id: str, rank: int) -> None:
        self.path = Path(report_dir) / f"{role}-{group_id}-rank{rank}.json" if report_dir else None
        self.data: dict[str, Any] = {"role": role, "group_id": group_id, "rank": rank}
        self._lock = threading.Lock()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.data.update(fields)
            if self.path is None:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.replace(self.path)


def layout_from_args(args: WorkerSettings) -> KvLayout:
    return KvLayout(
        num_layers=args.num_layers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_heads=args.num_heads,
        head_size=args.head_size,
        dtype=args.dtype,
    )


@dataclass
class RankSession:
    """What every entrypoint sets up before its own work, and tears down after it."""

    info: RankInfo
    reporter: Reporter
    stop: threading.Event
    layout: KvLayout
    client: RegistryClient

    def close(self) -> None:
        self.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_rank(args: WorkerSettings, role: str) -> RankSession:
    """Join the process group, log and report as this rank, stop on SIGTERM/SIGINT."""
    info = init_distributed(args)
    setup_logging(role, info, args.group_id)
    reporter = Reporter(args.report_dir, role, args.group_id, info.rank)
    reporter.update(node=info.node_rank, status="starting", pid=os.getpid())
    stop = threading.Event()
    stop_on_signals(stop)
    return RankSession(info, reporter, stop, layout_from_args(args), client_factory(args)())


def client_factory(args: WorkerSettings) -> Callable[[], RegistryClient]:
    def make() -> RegistryClient:
        return RegistryClient(
            args.registry_url, token=args.registry_token, timeout_s=args.timeout_s, tls=args.tls
        )

    return make


def establish_identity(
    args: WorkerSettings, client: RegistryClient, info: RankInfo, role: Role, layout: KvLayout
) -> EngineIdentity:
    """The engine_id this rank registers under (registry-issued, or node-made in bug mode)."""
    compat = layout.compat(args.model)
    if args.engine_id_source == "registry":
        return sync_engine_id(
            client,
            args.group_id,
            tp_size=info.world,
            role=role,
            compat=compat,
            cpu_group=info.cpu_group,
            allow_fallback=args.allow_fallback,
            timeout_s=args.timeout_s,
        )
    # Bug mode: rank 0 still opens the group's launch, but every node makes up its own id
    # and nobody compares (vLLM before its fix). The registry will refuse those ids.
    opened = ""
    if info.rank == 0:
        engine, _ = client.open_engine(
            args.group_id,
            launch_id=os.urandom(16).hex(),
            tp_size=info.world,
            role=role,
            compat=compat,
        )
        opened = engine.engine_id
    mine = local_engine_id()
    log.warning(
        "engine_id made up locally on node %d: %s%s",
        info.node_rank,
        mine,
        f" (the registry issued {opened} for this launch)" if opened else "",
    )
    return EngineIdentity(args.group_id, mine, 0, client.url, "", "local")


def _not_published(identity: EngineIdentity) -> bool:
    if identity.source != "fallback":
        return False
    log.warning(
        "NOT PUBLISHED: engine %s is rank 0's fallback id, unknown to any registry; "
        "decode instances cannot find this rank through the registry",
        identity.engine_id,
    )
    return True


def describe_agent(
    args: WorkerSettings,
    registry_url: str,
    info: RankInfo,
    identity: EngineIdentity,
    endpoint: NixlEndpoint,
    kv: KvSpec,
    hostnames: list[str],
) -> AgentItem | LocalFailure:
    """This rank's agent as the registry will hold it (its address: the one that routes to
    ``registry_url``), or why it cannot be (its verdict)."""
    try:
        host = advertise_host(registry_url, args.advertise_host)
        check_host_for_group(host, hostnames)
        return AgentItem(
            info.rank, identity.engine_id, endpoint.name, endpoint.metadata(), host, kv
        )
    except Exception as exc:
        return LocalFailure(info.rank, *verdict_of(exc))


def publish(
    args: WorkerSettings,
    client: RegistryClient,
    info: RankInfo,
    identity: EngineIdentity,
    endpoint: NixlEndpoint,
    kv: KvSpec,
    on_superseded: Callable[[EngineIdMismatch], None],
    *,
    linger_s: float = 0.0,
) -> RankPublication:
    """Publish this rank's agent (`args.publish`: per rank, or by its node's leader); all
    ranks agree on the outcome before anyone serves.

    One way down: the agent is described first (the endpoint's name and metadata, the
    address peers reach), then handed to the publication as a value (`workers.node`, or
    `workers.publication` per rank), which never calls back up but for `on_superseded`.
    Every failure on one rank becomes its verdict, so the others never wait for it alone.
    `linger_s`: how long a node's leader keeps its followers' leases after it is done itself.
    """
    hostnames: list[Any] = [None] * info.world
    dist.all_gather_object(hostnames, info.hostname, group=info.cpu_group)
    wanted = not _not_published(identity)
    what = f"agent registration for {args.group_id!r}"
    mine = describe_agent(
        args, client.url, info, identity, endpoint, kv, [str(h) for h in hostnames]
    )
    if args.publish == "per-node":
        return publish_per_node(
            client_factory(args),
            identity,
            mine,
            node=info.node_rank,
            cpu_group=info.cpu_group,
            collective_timeout_s=args.collective_timeout_s,
            ttl_s=args.ttl_s,
            linger_s=linger_s,
            wanted=wanted,
            what=what,
            on_superseded=on_superseded,
        )
    publication: Publication | None = None
    ok, cause, detail = True, "", ""
    if isinstance(mine, LocalFailure):
        ok, cause, detail = False, mine.cause, mine.detail
    else:
        try:
            publication = Publication(
                client_factory(args),
                identity,
                mine.rank,
                agent_name=mine.agent_name,
                metadata=mine.agent_metadata,
                host=mine.host,
                kv=mine.kv,
                ttl_s=args.ttl_s,
                on_superseded=on_superseded,
            )
            if wanted:
                publication.publish()
        except Exception as exc:
            ok = False
            cause, detail = verdict_of(exc)
    try:
        agree(ok, cause, detail, group=info.cpu_group, what=what)
    except EngineIdentityError:
        if publication is not None:
            publication.close(deregister=ok)
        raise
    assert publication is not None
    if publication.published:
        publication.start()
    return publication
