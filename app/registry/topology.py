"""Which prefill ranks a decode rank reads from, by vLLM's NIXL connector convention."""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """The two TP sizes cannot be paired: the larger is not a multiple of the smaller."""


@dataclass(frozen=True, slots=True)
class Plan:
    tp_ratio: int
    target_ranks: list[int]


def plan_targets(remote_tp: int, local_tp: int, local_rank: int) -> Plan:
    """Targets of decode rank ``local_rank`` (of ``local_tp``) in a prefill of ``remote_tp``.

    ``L >= R``: ``tp_ratio = L // R`` and the single target is ``r // tp_ratio``.
    ``L < R``: ``tp_ratio = -(R // L)`` and the targets are ``r*k … r*k + k - 1`` (k = R // L).
    """
    if remote_tp < 1 or local_tp < 1:
        raise TopologyError("TP sizes must be at least 1")
    if not 0 <= local_rank < local_tp:
        raise TopologyError(f"rank {local_rank} is outside 0..{local_tp - 1}")
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            raise TopologyError(f"decode TP {local_tp} is not a multiple of prefill TP {remote_tp}")
        ratio = local_tp // remote_tp
        return Plan(ratio, [local_rank // ratio])
    if remote_tp % local_tp:
        raise TopologyError(f"prefill TP {remote_tp} is not a multiple of decode TP {local_tp}")
    k = remote_tp // local_tp
    return Plan(-k, list(range(local_rank * k, local_rank * k + k)))
