"""One engine_id per launch of a TP group, agreed on by every rank.

`sync_engine_id` is the registry-backed counterpart of vLLM's `_sync_engine_id_across_tp`:

1. TP rank 0 opens the group's engine with a fresh `launch_id` (the registry issues the id).
2. Rank 0 broadcasts `(group_id, engine_id, generation, registry URL)` over the TP group.
3. Every other rank fetches its group's current engine from *its own* registry and compares;
   on a difference it asks its registry about rank 0's id to name the cause.
4. All ranks exchange their verdicts (an all-gather), so either every rank returns the same
   identity or every rank raises the same `EngineIdentityError`. No rank raises alone while
   the others wait in a later collective.

Which process group carries the objects: `broadcast_object_list`/`all_gather_object` pickle
into tensors on the group's device; with NCCL that would be a GPU tensor. So the exchange runs
on a CPU (gloo) group: the caller's `cpu_group` when given (vLLM keeps one per TP group),
the TP group itself when its backend is gloo, else a gloo group created over the same ranks
(`new_group` is collective over the default group: every rank of the world must call this
function then, as every rank of a TP world does under torchrun).

A collective with a rank that never arrives is bounded by the process group's timeout (the
entrypoints pass one to `init_process_group`); every registry call is bounded by a deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from registry_client.client import RegistryClient
from registry_client.errors import (
    EngineIdentityError,
    EngineSuperseded,
    Forbidden,
    NotFound,
    ProblemError,
    RegistryError,
    RegistryUnavailable,
    Unauthorized,
)
from registry_client.models import Compat, Role
from registry_client.models import EngineIdentity as EngineIdentity  # its home before models

log = logging.getLogger(__name__)

# Cause keys, and what the registry's own `engine_id_mismatch.cause` calls the same thing.
DIFFERENT_REGISTRY = "different_registry"  # API cause `unknown`
DIFFERENT_GROUP = "different_group"  # API cause `other_group`
SUPERSEDED = "superseded"  # API cause `superseded`
REGISTRY_UNREACHABLE = "registry_unreachable"
UNAUTHORIZED = "unauthorized"  # the registry refused this rank's token (401/403)
OPEN_FAILED = "open_failed"


@dataclass(frozen=True)
class _Verdict:
    rank: int
    ok: bool
    cause: str = ""
    detail: str = ""


def local_engine_id() -> str:
    """The engine_id a node would make up on its own, as vLLM did before its fix.

    One id per node-local launcher process (torchrun's agent is every local rank's parent), so
    ranks on one node agree and ranks on different nodes do not: the original bug. Used only to
    reproduce it (`--engine-id-source local`).
    """
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"node:{socket.gethostname()}:{os.getppid()}"))


def cpu_group_for(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group over the same ranks whose collectives use CPU tensors (see module doc)."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    cpu: dist.ProcessGroup | None = dist.new_group(ranks, backend="gloo")
    return cpu


def _open_as_rank0(
    client: RegistryClient,
    group_id: str,
    *,
    tp_size: int,
    role: Role,
    compat: Compat | None,
    launch_id: str,
    allow_fallback: bool,
    timeout_s: float,
) -> dict[str, Any]:
    try:
        engine, created = client.open_engine(
            group_id,
            launch_id=launch_id,
            tp_size=tp_size,
            role=role,
            compat=compat,
            timeout_s=timeout_s,
        )
    except RegistryUnavailable as exc:
        if not allow_fallback:
            return {"ok": False, "cause": REGISTRY_UNREACHABLE, "detail": str(exc)}
        fallback = str(uuid.uuid4())
        log.warning(
            "REGISTRY UNREACHABLE (%s): falling back to rank 0's own engine_id %s for group %s. "
            "It is broadcast to the TP group but NOT issued by a registry: decode instances "
            "cannot resolve it, and a relaunch will not be detected.",
            exc,
            fallback,
            group_id,
        )
        identity = EngineIdentity(group_id, fallback, 0, "", launch_id, "fallback")
        return {"ok": True, **asdict(identity)}
    except (Unauthorized, Forbidden) as exc:
        return {"ok": False, "cause": UNAUTHORIZED, "detail": _refused(client, exc)}
    except ProblemError as exc:
        return {"ok": False, "cause": OPEN_FAILED, "detail": f"opening the engine: {exc}"}
    log.info(
        "%s engine %s generation %d for group %s at %s",
        "opened" if created else "re-opened",
        engine.engine_id,
        engine.generation,
        group_id,
        client.url,
    )
    identity = EngineIdentity(
        group_id, engine.engine_id, engine.generation, client.url, launch_id, "registry"
    )
    return {"ok": True, **asdict(identity)}


def _refused(client: RegistryClient, exc: ProblemError) -> str:
    return (
        f"registry {client.url} refused this rank's token ({exc}): give every rank a bearer "
        "token with the worker role from the registry's tokens file (the vLLM plugin reads "
        "ENGINE_REGISTRY_TOKEN)"
    )


def _diagnose(
    client: RegistryClient, group_id: str, rank: int, announced: EngineIdentity, timeout_s: float
) -> _Verdict:
    """Compare rank 0's announcement with what this rank's registry says."""
    if announced.source == "fallback":
        log.warning("rank %d accepts rank 0's fallback engine_id %s", rank, announced.engine_id)
        return _Verdict(rank, True)
    here = client.url
    ids = f"rank 0 announced engine {announced.engine_id} (generation {announced.generation})"
    try:
        mine = client.get_engine(group_id, timeout_s=timeout_s)
        if mine.engine_id == announced.engine_id and group_id == announced.group_id:
            return _Verdict(rank, True)
    except NotFound:
        pass
    except RegistryUnavailable as exc:
        return _Verdict(rank, False, REGISTRY_UNREACHABLE, f"registry {here} unreachable: {exc}")
    except (Unauthorized, Forbidden) as exc:
        return _Verdict(rank, False, UNAUTHORIZED, _refused(client, exc))
    except RegistryError as exc:
        return _Verdict(rank, False, OPEN_FAILED, f"fetching group {group_id!r}: {exc}")
    try:
        theirs = client.resolve_engine(announced.engine_id, timeout_s=timeout_s)
    except NotFound:
        return _Verdict(
            rank,
            False,
            DIFFERENT_REGISTRY,
            f"{ids} from registry {announced.registry_url}, but this rank's registry {here} "
            "never issued it: the ranks talk to different registries",
        )
    except EngineSuperseded as exc:
        return _Verdict(
            rank,
            False,
            SUPERSEDED,
            f"{ids}, but a newer launch superseded it: the current engine is "
            f"{exc.current_engine_id} (generation {exc.current_generation})",
        )
    except RegistryUnavailable as exc:
        return _Verdict(rank, False, REGISTRY_UNREACHABLE, f"registry {here} unreachable: {exc}")
    except RegistryError as exc:
        return _Verdict(rank, False, OPEN_FAILED, f"resolving {announced.engine_id}: {exc}")
    if theirs.group_id != group_id:
        return _Verdict(
            rank,
            False,
            DIFFERENT_GROUP,
            f"{ids} of group {theirs.group_id!r}, but this rank was launched for group "
            f"{group_id!r}: group ids differ across nodes",
        )
    return _Verdict(
        rank,
        False,
        SUPERSEDED,
        f"{ids}, but group {group_id!r} moved on while the ranks compared: launch again",
    )


def agree(verdict_ok: bool, cause: str, detail: str, *, group: Any, what: str) -> None:
    """All-gather a per-rank verdict; raise the same error on every rank if any failed."""
    rank = dist.get_rank(group)
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, _Verdict(rank, verdict_ok, cause, detail), group=group)
    failed = [v for v in verdicts if isinstance(v, _Verdict) and not v.ok]
    if not failed:
        return
    causes = {v.rank: v.cause for v in failed}
    details = {v.rank: v.detail for v in failed}
    lines = "; ".join(f"rank {v.rank}: {v.cause}: {v.detail}" for v in failed)
    raise EngineIdentityError(
        f"{what} failed on {len(failed)} rank(s): {lines}", causes=causes, details=details
    )


def sync_engine_id(
    client: RegistryClient,
    group_id: str,
    *,
    tp_size: int,
    role: Role,
    compat: Compat | None = None,
    group: dist.ProcessGroup | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    launch_id: str | None = None,
    allow_fallback: bool = False,
    timeout_s: float = 30.0,
) -> EngineIdentity:
    """Agree on the TP group's engine_id (module doc); collective over `group`."""
    if dist.get_world_size(group) != tp_size:
        raise ValueError(f"tp_size {tp_size} != process group size {dist.get_world_size(group)}")
    exchange = cpu_group if cpu_group is not None else cpu_group_for(group)
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = _open_as_rank0(
                client,
                group_id,
                tp_size=tp_size,
                role=role,
                compat=compat,
                launch_id=launch_id or uuid.uuid4().hex,
                allow_fallback=allow_fallback,
                timeout_s=timeout_s,
            )
        except Exception as exc:  # never leave the other ranks waiting in the broadcast
            log.exception("rank 0 could not open the engine")
            payload[0] = {"ok": False, "cause": OPEN_FAILED, "detail": repr(exc)}
    dist.broadcast_object_list(payload, src=src, group=exchange)
    announced: dict[str, Any] = payload[0]
    if not announced.get("ok"):
        verdict = _Verdict(rank, False, str(announced["cause"]), f"rank 0: {announced['detail']}")
        identity = None
    else:
        identity = EngineIdentity(**{k: v for k, v in announced.items() if k != "ok"})
        try:
            verdict = (
                _Verdict(rank, True)
                if rank == 0
                else _diagnose(client, group_id, rank, identity, timeout_s)
            )
        except Exception as exc:  # a verdict, not a lone raise: the others wait in agree()
            log.exception("rank %d could not check the engine", rank)
            verdict = _Verdict(rank, False, OPEN_FAILED, repr(exc))
    agree(
        verdict.ok,
        verdict.cause,
        verdict.detail,
        group=exchange,
        what=f"engine_id cross-verify for group {group_id!r}",
    )
    assert identity is not None
    log.info("rank %d verified engine %s (%s)", rank, identity.engine_id, identity.source)
    return identity


def sync_kv_transfer_engine_id(
    vllm_config: Any,
    client: RegistryClient,
    group_id: str,
    *,
    tp_size: int,
    role: Role,
    compat: Compat | None = None,
    group: dist.ProcessGroup | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    allow_fallback: bool = False,
    timeout_s: float = 30.0,
) -> EngineIdentity:
    """Drop-in for vLLM's `_sync_engine_id_across_tp`: agree, then set
    `vllm_config.kv_transfer_config.engine_id` on this rank."""
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_config is None:
        raise ValueError("config has no kv_transfer_config to set the engine_id on")
    identity = sync_engine_id(
        client,
        group_id,
        tp_size=tp_size,
        role=role,
        compat=compat,
        group=group,
        cpu_group=cpu_group,
        allow_fallback=allow_fallback,
        timeout_s=timeout_s,
    )
    kv_config.engine_id = identity.engine_id
    return identity
