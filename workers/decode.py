"""Decode TP worker: `torchrun ... -m workers.decode --registry URL --group-id D
--prefill-group P` (or `--prefill-engine-id E`).

Each rank joins its own TP group and engine like a prefill rank does, then pulls KV blocks
from the prefill engine: ask the registry for the handshake plan (which prefill ranks, their
NIXL metadata and memory), load those agents, READ exactly this rank's head slices of the
chosen blocks, verify them byte for byte, and notify the prefill ranks.

Remote agents are cached per prefill engine_id. Before each round after the first, the rank
checks its engine_id with the registry (`GET /engines/{id}`, the stand-in for a request that
names its prefill engine): a 410 evicts the cached agents and follows `current_engine_id`
(a relaunched prefill); a failed transfer evicts too and re-resolves.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from registry_client.client import RegistryClient
from registry_client.errors import (
    EngineIdentityError,
    EngineSuperseded,
    Incompatible,
    InvalidRequest,
    NotFound,
    NotReady,
    RegistryUnavailable,
    TransferError,
    VerificationError,
)
from registry_client.models import Compat, Handshake, KvSpec
from workers import launch
from workers.endpoint import NixlEndpoint, RemoteRead
from workers.kv import KvLayout, ReadOp, kv_spec, plan_reads, verify
from workers.settings import DecodeSettings, parse_decode

log = logging.getLogger("workers.decode")


def parse_args(argv: list[str] | None = None) -> DecodeSettings:
    return parse_decode(argv, __doc__)


@dataclass
class Plan:
    handshake: Handshake
    ops: list[ReadOp]
    handshake_s: float


class RemoteEngines:
    """NIXL agents of prefill engines, loaded once per engine_id."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        client: RegistryClient,
        layout: KvLayout,
        *,
        tp_size: int,
        rank: int,
        local: KvSpec,
        compat: Compat,
        local_blocks: list[int],
        remote_blocks: list[int],
        timeout_s: float,
    ) -> None:
        self.endpoint = endpoint
        self.client = client
        self.layout = layout
        self.tp_size = tp_size
        self.rank = rank
        self.local = local
        self.compat = compat
        self.local_blocks = local_blocks
        self.remote_blocks = remote_blocks
        self.timeout_s = timeout_s
        self.plans: dict[str, Plan] = {}

    def get(self, engine_id: str) -> Plan:
        plan = self.plans.get(engine_id)
        if plan is not None:
            return plan
        start = time.perf_counter()
        hs = self.client.handshake(
            engine_id,
            tp_size=self.tp_size,
            rank=self.rank,
            compat=self.compat,
            timeout_s=self.timeout_s,
        )
        ops = plan_reads(
            self.layout,
            local_tp=self.tp_size,
            local_rank=self.rank,
            local=self.local,
            remote_tp=hs.remote_tp_size,
            tp_ratio=hs.tp_ratio,
            targets={t.rank: t.kv for t in hs.targets},
            local_block_ids=self.local_blocks,
            remote_block_ids=self.remote_blocks,
        )
        loaded: list[str] = []
        try:
            for target in hs.targets:
                loaded.append(self.endpoint.add_remote(target))
        except Exception:
            for name in loaded:  # all of an engine's agents or none
                self.endpoint.remove_remote(name)
            raise
        plan = Plan(hs, ops, time.perf_counter() - start)
        self.plans[engine_id] = plan
        log.info(
            "handshake with engine %s (group %s generation %d, TP %d, ratio %d): ranks %s "
            "loaded in %.1f ms",
            engine_id,
            hs.group_id,
            hs.generation,
            hs.remote_tp_size,
            hs.tp_ratio,
            [t.rank for t in hs.targets],
            plan.handshake_s * 1000,
        )
        return plan

    def evict(self, engine_id: str) -> None:
        plan = self.plans.pop(engine_id, None)
        if plan is not None:
            for target in plan.handshake.targets:
                self.endpoint.remove_remote(target.agent_name)

    def close(self) -> None:
        for engine_id in list(self.plans):
            self.evict(engine_id)


def read_round(
    args: DecodeSettings,
    engines: RemoteEngines,
    engine_id: str,
    buffer: torch.Tensor,
    info: launch.RankInfo,
    me: str,
) -> dict[str, Any]:
    """One verified pull of every chosen block from `engine_id`; returns its figures."""
    plan = engines.get(engine_id)
    buffer.zero_()
    start = time.perf_counter()
    names = {t.rank: (t.agent_name, t.kv.mem_type) for t in plan.handshake.targets}
    reads = [
        RemoteRead(names[op.remote_rank][0], op.local, op.remote, names[op.remote_rank][1])
        for op in plan.ops
    ]
    engines.endpoint.read(
        reads, local_mem_type=engines.local.mem_type, deadline_s=args.transfer_timeout_s
    )
    seconds = time.perf_counter() - start
    try:
        checked = verify(
            buffer, engine_id, engines.layout, info.world, info.rank, engines.remote_blocks
        )
    except ValueError as exc:
        raise VerificationError(f"blocks from engine {engine_id}: {exc}") from exc
    nbytes = sum(op.nbytes for op in plan.ops)
    heads = engines.layout.local_heads(info.world)
    message = f"verified by {me} rank {info.rank}: {len(engines.remote_blocks)} blocks".encode()
    for target in plan.handshake.targets:
        engines.endpoint.notify(target.agent_name, message)
    return {
        "engine_id": engine_id,
        "generation": plan.handshake.generation,
        "targets": [t.rank for t in plan.handshake.targets],
        "heads": [info.rank * heads, (info.rank + 1) * heads - 1],
        "bytes": nbytes,
        "verified_bytes": checked,
        "transfer_s": seconds,
        "handshake_s": plan.handshake_s,
    }


def pull(
    args: DecodeSettings,
    engines: RemoteEngines,
    engine_id: str,
    buffer: torch.Tensor,
    info: launch.RankInfo,
    me: str,
    stop: threading.Event,
    reporter: launch.Reporter,
) -> int:
    rounds: list[dict[str, Any]] = []
    seen: list[str] = []
    deadline = time.monotonic() + args.deadline_s
    failures = 0
    while not stop.is_set():
        if len(rounds) >= args.rounds and len(seen) >= args.until_engines:
            return launch.EXIT_OK
        if time.monotonic() > deadline:
            log.error("deadline of %.0fs passed after %d rounds", args.deadline_s, len(rounds))
            return launch.EXIT_TRANSFER
        try:
            if engine_id in engines.plans:
                engines.client.resolve_engine(engine_id)  # 410 when relaunched
            figures = read_round(args, engines, engine_id, buffer, info, me)
        except EngineSuperseded as exc:
            log.warning(
                "engine %s answered 410: superseded by %s (generation %s); evicting its "
                "agents and handshaking again",
                engine_id,
                exc.current_engine_id,
                exc.current_generation,
            )
            engines.evict(engine_id)
            if exc.current_engine_id is None:
                return launch.EXIT_TRANSFER
            engine_id = exc.current_engine_id
            continue
        except (Incompatible, InvalidRequest, NotFound, ValueError) as exc:
            # Facts, not weather: a retry would get the same answer.
            log.error("CANNOT READ FROM ENGINE %s: %s", engine_id, exc)
            reporter.update(status="refused", error=str(exc), rounds=rounds)
            return launch.EXIT_TRANSFER
        except (TransferError, NotReady, RegistryUnavailable) as exc:
            failures += 1
            log.warning("round failed (%s); evicting engine %s and retrying", exc, engine_id)
            engines.evict(engine_id)
            stop.wait(min(2.0, 0.1 * 2 ** min(failures, 5)))
            continue
        failures = 0
        rounds.append(figures)
        if engine_id not in seen:
            seen.append(engine_id)
        log.info(
            "round %d: %d bytes from engine %s ranks %s in %.2f ms (%.1f MB/s), verified",
            len(rounds),
            figures["bytes"],
            engine_id,
            figures["targets"],
            figures["transfer_s"] * 1000,
            figures["bytes"] / max(figures["transfer_s"], 1e-9) / 1e6,
        )
        reporter.update(rounds=rounds, engines_seen=seen, status="reading")
        stop.wait(args.round_interval_s)
    return launch.EXIT_ERROR


def wait_for_group(client: RegistryClient, group_id: str, args: DecodeSettings) -> str:
    """The group's current engine_id once it is ready: the prefill may not have opened it yet
    (a 404 until its rank 0 gets there), so wait for it, up to the deadline."""
    deadline = time.monotonic() + args.deadline_s
    pause = 0.1
    while True:
        left = deadline - time.monotonic()
        try:
            engine = client.get_engine(group_id, wait_ready_s=max(0.0, min(30.0, left)))
        except NotFound:
            if left <= 0:
                raise
            log.info("prefill group %s not opened yet; waiting", group_id)
            time.sleep(min(pause, max(left, 0.0)))
            pause = min(pause * 2, 2.0)
            continue
        if engine.ready or left <= 0:
            return engine.engine_id


def run(args: DecodeSettings) -> int:
    session = launch.start_rank(args, "decode")
    info, reporter, stop = session.info, session.reporter, session.stop
    layout, client = session.layout, session.client
    endpoint: NixlEndpoint | None = None
    publication = None
    engines: RemoteEngines | None = None
    try:
        try:
            identity = launch.establish_identity(args, client, info, "decode", layout)
        except EngineIdentityError as exc:
            log.error("%s", exc)
            reporter.update(status="identity_failed", error=str(exc), causes=exc.causes)
            return launch.EXIT_IDENTITY
        reporter.update(engine_id=identity.engine_id, generation=identity.generation)
        nblocks = args.read_blocks or layout.num_blocks
        remote_blocks = [layout.num_blocks - 1 - i for i in range(nblocks)]  # reversed
        buffer = layout.allocate(info.world, nblocks, device=args.device)
        endpoint = NixlEndpoint(f"{identity.engine_id}-rank{info.rank}")
        endpoint.register(buffer)
        local = kv_spec(buffer, layout.local_heads(info.world))
        try:
            publication = launch.publish(
                args,
                client,
                info,
                identity,
                endpoint,
                local,
                lambda exc: stop.set(),
                linger_s=args.deadline_s,
            )
        except EngineIdentityError as exc:
            log.error("REGISTRY REFUSED THE AGENTS: %s", exc)
            reporter.update(status="refused", error=str(exc), causes=exc.causes)
            return launch.EXIT_REFUSED
        engine_id = args.prefill_engine_id or wait_for_group(client, str(args.prefill_group), args)
        engines = RemoteEngines(
            endpoint,
            client,
            layout,
            tp_size=info.world,
            rank=info.rank,
            local=local,
            compat=layout.compat(args.model),
            local_blocks=list(range(nblocks)),
            remote_blocks=remote_blocks,
            timeout_s=args.handshake_timeout_s,
        )
        try:
            code = pull(args, engines, engine_id, buffer, info, endpoint.name, stop, reporter)
        except VerificationError as exc:
            log.error("VERIFICATION FAILED: %s", exc)
            reporter.update(status="verification_failed", error=str(exc))
            return launch.EXIT_TRANSFER
        if code == launch.EXIT_OK:
            reporter.update(status="done", exit_code=code)
        elif reporter.data.get("status") != "refused":
            reporter.update(status="failed", exit_code=code)
        return code
    finally:
        if engines is not None:
            engines.close()
        if publication is not None:
            publication.close()
        if endpoint is not None:
            endpoint.close()
        session.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception:
        logging.getLogger("workers").exception("decode rank failed")
        return launch.EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
