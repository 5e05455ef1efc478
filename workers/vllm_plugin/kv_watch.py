"""A deadline on every KV pull a decode worker waits for, said in its log.

vLLM's NIXL connector (pull mode) posts one READ per remote rank and polls them once per engine
step (`get_transfer_results`, on the worker's main thread). A READ that never completes makes
the request wait with nothing in the log until the prefill side's lease on the blocks runs out
(and, with the default failure policy, longer). This watch runs right after each poll, on that
same thread, reads the connector's own bookkeeping (no NIXL call of its own), and logs, per
request waiting longer than `warn_s`, at which stage it is:

- ``handshake pending``: no READ posted yet, the NIXL handshake with the engine is in flight;
- ``READ posted``: N READs posted (one per remote rank), still in progress after the poll;
- ``not posted``: waiting, no READ and no handshake in flight.

The line repeats every `every_s` while the request waits, and a last one says when it ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MARK = "engine-registry: KV pull"


@dataclass(frozen=True)
class Waiting:
    """One request's pull as the connector's bookkeeping shows it after a poll."""

    req_id: str
    engine_id: str
    reads_in_progress: int
    handshake_pending: bool

    @property
    def stage(self) -> str:
        if self.reads_in_progress:
            return f"READ posted: {self.reads_in_progress} NIXL READ(s) still in progress"
        if self.handshake_pending:
            return "handshake pending: no READ posted, the NIXL handshake is in flight"
        return "not posted: no READ and no handshake in flight"


def waiting_of(worker: Any) -> list[Waiting]:
    """The requests a NIXL connector worker is waiting on, from its own bookkeeping."""
    metadata: Mapping[str, Any] = getattr(worker, "_recving_metadata", {}) or {}
    transfers: Mapping[str, list[int]] = getattr(worker, "_recving_transfers", {}) or {}
    futures: Mapping[str, Any] = getattr(worker, "_handshake_futures", {}) or {}
    out = []
    for req_id, meta in list(metadata.items()):
        remote = getattr(meta, "remote", None)
        engine_id = str(getattr(remote, "engine_id", "") or "")
        out.append(Waiting(req_id, engine_id, len(transfers.get(req_id, ())), engine_id in futures))
    return out


@dataclass
class KvWatch:
    """Tracks how long each request has waited; says so past `warn_s`, then every `every_s`."""

    warn_s: float = 10.0
    every_s: float = 30.0
    log: Callable[[str], None] = logging.getLogger("vllm.engine_registry").warning
    clock: Callable[[], float] = time.monotonic
    first_seen: dict[str, float] = field(default_factory=dict)
    last_said: dict[str, float] = field(default_factory=dict)

    def observe(self, waiting: Iterable[Waiting]) -> None:
        now = self.clock()
        current = {w.req_id: w for w in waiting}
        for req_id in [r for r in self.first_seen if r not in current]:
            started = self.first_seen.pop(req_id)
            if self.last_said.pop(req_id, None) is not None:
                self.log(f"{MARK} for request {req_id} ended after {now - started:.1f} s")
        for req_id, w in current.items():
            started = self.first_seen.setdefault(req_id, now)
            waited = now - started
            said = self.last_said.get(req_id)
            if waited >= self.warn_s and (said is None or now - said >= self.every_s):
                self.last_said[req_id] = now
                self.log(
                    f"{MARK} for request {req_id} from engine {w.engine_id} has waited "
                    f"{waited:.1f} s: {w.stage}"
                )


def attach(connector: Any, watch: KvWatch) -> bool:
    """Run `watch` after each of the connector worker's polls; False when it has none."""
    worker = getattr(connector, "connector_worker", None)
    poll = getattr(worker, "get_transfer_results", None)
    if worker is None or poll is None or not hasattr(worker, "_recving_metadata"):
        return False

    def poll_then_watch(*args: Any, **kwargs: Any) -> Any:
        result = poll(*args, **kwargs)
        try:
            watch.observe(waiting_of(worker))
        except Exception:  # the watch must never fail a step
            logging.getLogger("vllm.engine_registry").debug("kv watch failed", exc_info=True)
        return result

    worker.get_transfer_results = poll_then_watch
    return True
