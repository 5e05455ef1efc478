"""What happened, kept bounded in the store: refusals and handshakes, each with its time.

Events are recorded into a bounded in-memory buffer on the replica that saw them and written
to the store in batches, at most once per ``flush_interval_s`` (one transaction per 100
events; etcd refuses larger ones by default). A request never waits for a store write:
recording is a dictionary update. The store keeps the newest ``keep`` events under
``events/{id}``: once a replica's count passes ``keep + keep // 10`` it deletes the oldest
(so the store holds at most that many per replica writing).

Handshakes are recorded only when they are new information: the first plan of a decode rank
(by its TP size and rank) against a prefill engine_id (one engine_id per generation). A rank
handshaking again against the same engine adds nothing, and costs one dictionary lookup.
Identical refusals within one flush are folded into one event with a ``count``.

Ids sort by time: ``{unix_ms:013d}-{replica:8 hex}-{sequence:06d}``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Hashable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from app.errors import InvalidRequest, RegistryError
from app.metrics import Metrics
from app.store import Delete, Put, Store, Unavailable
from app.timefmt import utc_iso

log = logging.getLogger("app.events")

PREFIX = "events/"
TXN_OPS = 100  # below etcd's default --max-txn-ops (128)
SEEN_LIMIT = 100_000  # handshake keys remembered before the memory starts over

Kind = Literal[
    "engine_id_mismatch",
    "incompatible",
    "launch_superseded",
    "engine_superseded",
    "handshake",
    "lease_expired",
]
REFUSALS = frozenset(
    {"engine_id_mismatch", "incompatible", "launch_superseded", "engine_superseded"}
)

_ID = re.compile(r"^\d{13}-[0-9a-f]{8}-\d{6}$")
_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$")


class Event(BaseModel):
    id: str
    at: str
    kind: Kind
    group_id: str
    detail: str
    count: int = 1
    fields: dict[str, Any]


class Events(BaseModel):
    events: list[Event]
    last_id: str | None
    truncated: bool


def since_key(since: str | None) -> str:
    """The lowest store key after ``since``: an event id (exclusive) or an RFC 3339 time."""
    if not since:
        return PREFIX
    if _ID.fullmatch(since):
        return f"{PREFIX}{since}~"  # "~" sorts after every id character: strictly after
    if _TIME.fullmatch(since):
        try:
            ms = int(datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp() * 1000)
        except (ValueError, OverflowError):
            ms = -1
        if ms >= 0:
            return f"{PREFIX}{ms:013d}"
    raise InvalidRequest(
        f"since={since!r} is neither an event id (like 1764543600000-1a2b3c4d-000001, the "
        "last_id of a previous answer) nor an RFC 3339 time (like 2026-11-30T23:00:00Z).",
        errors=[{"loc": ["query", "since"], "msg": "not an event id or time", "type": "since"}],
    )


class EventLog:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        keep: int = 1000,
        flush_interval_s: float = 1.0,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.keep = keep
        self.flush_interval_s = flush_interval_s
        self.slack = max(1, keep // 10)  # trimmed past keep + slack: a range read per slack
        self.replica = os.urandom(4).hex()
        self._seq = itertools.count(1)
        self._pending: dict[Hashable, Event] = {}
        self._seen: dict[tuple[str, int], set[int]] = {}
        self._parsed: dict[str, Event] = {}
        self._stored: int | None = None  # events in the store, as last counted plus written
        self._last_flush = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    # -- recording (no I/O) -------------------------------------------------------------------

    def _new(self, kind: Kind, group_id: str, detail: str, fields: dict[str, Any]) -> Event:
        now = time.time()
        return Event(
            id=f"{int(now * 1000):013d}-{self.replica}-{next(self._seq) % 1_000_000:06d}",
            at=utc_iso(now),
            kind=kind,
            group_id=group_id,
            detail=detail,
            fields=fields,
        )

    def record(
        self, kind: Kind, group_id: str, detail: str, fold: Hashable, fields: dict[str, Any]
    ) -> None:
        """Buffer an event; one identical to a buffered one (same ``fold``) adds to its count."""
        key = (kind, fold)
        held = self._pending.get(key)
        if held is not None:
            held.count += 1
            held.at = utc_iso(time.time())
            return
        if len(self._pending) >= self.keep:
            self._pending.pop(next(iter(self._pending)))
            self.metrics.events_dropped.inc()
        self._pending[key] = self._new(kind, group_id, detail, fields)
        self._schedule()

    def refusal(self, error: RegistryError, group_id: str, **fields: Any) -> None:
        """A refused request: the error's code is the kind, its detail the event's."""
        kind: Kind = error.code  # type: ignore[assignment]  # callers pass refusals only
        extras = {k: v for k, v in error.extras.items() if v is not None}
        extras.update(fields)
        fold = (group_id, *sorted((k, repr(v)) for k, v in extras.items()))
        self.record(kind, group_id, error.detail, fold, extras)

    def handshake(
        self,
        engine_id: str,
        group_id: str,
        generation: int,
        decode_tp_size: int,
        decode_rank: int,
        target_ranks: list[int],
    ) -> None:
        """The first plan of this decode rank against this engine; again: nothing."""
        key = (engine_id, decode_tp_size)
        ranks = self._seen.get(key)
        if ranks is not None and decode_rank in ranks:
            return
        if ranks is None:
            if len(self._seen) >= SEEN_LIMIT:
                self._seen.clear()
            ranks = self._seen[key] = set()
        ranks.add(decode_rank)
        held = self._pending.get(("handshake", key))
        if held is not None:  # this second's event for the pair: add the rank to it
            held.fields["decode_ranks"] = sorted(ranks)
            held.fields["target_ranks"] = sorted({*held.fields["target_ranks"], *target_ranks})
            held.detail = _handshake_detail(held.fields)
            return
        fields = {
            "engine_id": engine_id,
            "generation": generation,
            "decode_tp_size": decode_tp_size,
            "decode_ranks": sorted(ranks),
            "target_ranks": sorted(target_ranks),
        }
        self.record("handshake", group_id, _handshake_detail(fields), key, fields)

    # -- writing ------------------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._timer is not None or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # recorded outside a loop (a unit test): flushed by the next flush()
        delay = max(0.0, self._last_flush + self.flush_interval_s - time.monotonic())
        self._timer = loop.call_later(delay, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._flush_then_reschedule())

    async def _flush_then_reschedule(self) -> None:
        await self.flush()
        if self._pending:
            self._task = None
            self._schedule()

    async def flush(self) -> None:
        """Write the buffered events (and trim the store to ``keep``). On a store failure
        they stay buffered (bounded) for the next flush."""
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        batch = list(self._pending.values())
        self._pending.clear()
        try:
            for i in range(0, len(batch), TXN_OPS):
                puts = [
                    Put(PREFIX + e.id, e.model_dump_json().encode()) for e in batch[i : i + TXN_OPS]
                ]
                await self.store.txn([], puts)
            await self._trim(len(batch))
        except Unavailable as exc:
            log.warning(
                "events not written yet, kept for the next flush", extra={"error": str(exc)}
            )
            for event in batch[-self.keep :]:
                self._pending.setdefault(("unwritten", event.id), event)

    async def _trim(self, written: int) -> None:
        if self._stored is not None:
            self._stored += written
            if self._stored <= self.keep + self.slack:
                return
        keys = [e.key for e in (await self.store.range(PREFIX)).entries]
        self._stored = len(keys)
        excess = keys[: max(0, len(keys) - self.keep)]
        for i in range(0, len(excess), TXN_OPS):
            await self.store.txn([], [Delete(k) for k in excess[i : i + TXN_OPS]])
        self._stored -= len(excess)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()

    # -- reading ------------------------------------------------------------------------------

    async def read(self, since: str | None = None, limit: int = 100) -> Events:
        """Events after ``since``, oldest first: the newest ``limit`` of them. Events this
        replica has not written yet are included."""
        low = since_key(since)
        snap = await self.store.range(PREFIX)
        parsed = {}  # stored events never change: each is parsed once
        for entry in snap.entries:
            held = self._parsed.get(entry.key)
            parsed[entry.key] = held or Event.model_validate_json(entry.value)
        self._parsed = parsed
        by_id = {k: e for k, e in parsed.items() if k >= low}
        for event in self._pending.values():
            if PREFIX + event.id >= low:
                by_id.setdefault(PREFIX + event.id, event)
        ordered = [by_id[k] for k in sorted(by_id)]
        chosen = ordered[-limit:] if limit else []
        return Events(
            events=chosen,
            last_id=chosen[-1].id if chosen else None,
            truncated=len(ordered) > len(chosen),
        )


def _handshake_detail(f: dict[str, Any]) -> str:
    return (
        f"decode TP {f['decode_tp_size']} ranks {_ranks(f['decode_ranks'])} planned against "
        f"prefill engine {f['engine_id']} (generation {f['generation']}), target ranks "
        f"{_ranks(f['target_ranks'])}"
    )


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:16])) + ("…" if len(ranks) > 16 else "")
