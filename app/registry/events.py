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
Identical refusals within one flush are folded into one event with a ``count``; past
``FOLD_AFTER`` distinct refusals of one kind for one group within one flush, the rest fold
into one event too (``fields.folded``), so a flood of made-up ids makes a few events a second.

Refusals never crowd out the other kinds: when the buffer is full a refusal goes first, and
the store's trim keeps the newest ``keep // 2`` handshakes and lease expiries whatever the
refusals did. Each event is at most ``EVENT_BYTES`` of JSON (``app.core.budgets``); an event the
store still refuses for its size is dropped and counted, never sent again.

An event a request caused names the request's token in ``fields.token``: the name the tokens
file gives it (``name=``), never the token (a folded event names its first request's).

Ids sort by time: ``{unix_ms:013d}-{replica:8 hex}-{sequence:06d}``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Hashable, Iterable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from app.core.budgets import LIST_ITEMS, bounded_event
from app.core.errors import InvalidRequest, RegistryError
from app.core.metrics import Metrics
from app.core.timefmt import utc_iso
from app.security.credentials import ACTOR
from app.store import Delete, Entry, Put, Store, TooLarge, Unavailable

log = logging.getLogger("app.registry.events")

PREFIX = "events/"
TXN_OPS = 100  # below etcd's default --max-txn-ops (128)
SEEN_LIMIT = 100_000  # decode ranks remembered (all pairs together) before it starts over
FOLD_AFTER = 16  # distinct refusals of one kind for one group per flush, then they fold

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

_KIND = re.compile(rb'"kind":"([a-z_]+)"')
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
        self._refusals: dict[Hashable, Event] = {}  # buffered, by fold key
        self._others: dict[Hashable, Event] = {}
        self._distinct: dict[tuple[str, str], int] = {}  # refusals by (kind, group) this flush
        # engine_id -> (decode TP, decode group or "", its engine or "") -> ranks
        self._seen: dict[str, dict[tuple[int, str, str], set[int]]] = {}
        self._seen_ranks = 0
        self._parsed: dict[str, Event] = {}
        self._stored: int | None = None  # events in the store, as last counted plus written
        self._last_flush = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    # -- recording (no I/O) -------------------------------------------------------------------

    def _new(self, kind: Kind, group_id: str, detail: str, fields: dict[str, Any]) -> Event:
        now = time.time()
        if (actor := ACTOR.get()) is not None:  # the name of the token whose request it was
            fields = {**fields, "token": actor}
        detail, fields = bounded_event(detail, fields)
        return Event(
            id=f"{int(now * 1000):013d}-{self.replica}-{next(self._seq) % 1_000_000:06d}",
            at=utc_iso(now),
            kind=kind,
            group_id=group_id,
            detail=detail,
            fields=fields,
        )

    @property
    def _pending(self) -> list[Event]:
        """Every buffered event, oldest first."""
        return sorted((*self._refusals.values(), *self._others.values()), key=lambda e: e.id)

    def record(
        self, kind: Kind, group_id: str, detail: str, fold: Hashable, fields: dict[str, Any]
    ) -> None:
        """Buffer an event; one identical to a buffered one (same ``fold``) adds to its count."""
        buffer = self._refusals if kind in REFUSALS else self._others
        key: Hashable = (kind, fold)
        held = buffer.get(key)
        if held is not None:
            held.count += 1
            held.at = utc_iso(time.time())
            return
        if kind in REFUSALS:
            n = self._distinct.get((kind, group_id), 0)
            self._distinct[(kind, group_id)] = n + 1
            if n >= FOLD_AFTER:  # a flood of distinct refusals: the rest fold into one
                key = (kind, group_id, "folded")
                fields = {**fields, "folded": True}
                held = buffer.get(key)
                if held is not None:  # it shows the latest of them, and how many
                    held.count += 1
                    held.at = utc_iso(time.time())
                    held.detail, held.fields = bounded_event(detail, fields)
                    return
        if len(self._refusals) + len(self._others) >= self.keep:
            full = self._refusals or self._others  # a refusal goes first
            full.pop(next(iter(full)))
            self.metrics.events_dropped.inc()
        buffer[key] = self._new(kind, group_id, detail, fields)
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
        decode: dict[str, str] | None = None,
    ) -> None:
        """The first plan of this decode rank against this engine; again: nothing. What is
        remembered is bounded (``SEEN_LIMIT`` ranks in all), and so is what an event lists
        (``LIST_ITEMS`` ranks of each kind, with ``decode_rank_count``). ``decode`` names
        the asking side (``group_id``, ``engine_id``) when it said."""
        asking = decode or {}
        # The decode's engine is part of the side: a relaunched decode group is recorded anew.
        side = (decode_tp_size, asking.get("group_id", ""), asking.get("engine_id", ""))
        key = (engine_id, *side)
        by_tp = self._seen.get(engine_id)
        ranks = None if by_tp is None else by_tp.get(side)
        if ranks is not None and decode_rank in ranks:
            return
        if self._seen_ranks >= SEEN_LIMIT:
            self._seen.clear()
            self._seen_ranks = 0
            ranks = None
        if ranks is None:
            ranks = self._seen.setdefault(engine_id, {}).setdefault(side, set())
        ranks.add(decode_rank)
        self._seen_ranks += 1
        held = self._others.get(("handshake", key))
        if held is not None:  # this second's event for the pair: add the rank to it
            f = held.fields
            f["decode_rank_count"] = f.get("decode_rank_count", 1) + 1
            f["decode_ranks"] = _some(f["decode_ranks"], [decode_rank])
            f["target_ranks"] = _some(f["target_ranks"], target_ranks)
            held.detail = _handshake_detail(f)
            return
        fields = {
            "engine_id": engine_id,
            "generation": generation,
            "decode_tp_size": decode_tp_size,
            "decode_ranks": [decode_rank],
            "decode_rank_count": 1,
            "target_ranks": _some([], target_ranks),
        }
        if decode:
            fields.update({f"decode_{k}": v for k, v in decode.items()})
        self.record("handshake", group_id, _handshake_detail(fields), key, fields)

    def forget_engines(self, engine_ids: Iterable[str]) -> None:
        """These engines are gone (their group deleted or relaunched): nothing more is
        remembered of their handshakes."""
        for engine_id in engine_ids:
            by_tp = self._seen.pop(engine_id, None)
            if by_tp is not None:
                self._seen_ranks -= sum(len(ranks) for ranks in by_tp.values())

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
        they stay buffered (bounded) for the next flush; an event the store refuses for its
        size is dropped (counted), never sent again."""
        self._last_flush = time.monotonic()
        self._distinct.clear()
        batch = self._pending
        if not batch:
            return
        self._refusals.clear()
        self._others.clear()
        written = 0
        try:
            for i in range(0, len(batch), TXN_OPS):
                chunk = batch[i : i + TXN_OPS]
                written += await self._write(chunk)
            await self._trim(written)
        except Unavailable as exc:
            log.warning(
                "events not written yet, kept for the next flush", extra={"error": str(exc)}
            )
            for event in batch[written:][-self.keep :]:
                buffer = self._refusals if event.kind in REFUSALS else self._others
                buffer.setdefault(("unwritten", event.id), event)

    async def _write(self, chunk: list[Event]) -> int:
        """Write ``chunk`` in one transaction; if the store refuses it for its size, each
        event alone, dropping those it refuses alone. Returns how many were handled."""
        puts = [Put(PREFIX + e.id, e.model_dump_json().encode()) for e in chunk]
        try:
            await self.store.txn([], puts)
            return len(chunk)
        except TooLarge:
            pass
        for put in puts:
            try:
                await self.store.txn([], [put])
            except TooLarge as exc:
                self.metrics.events_dropped.inc()
                log.warning(
                    "an event the store refuses for its size was dropped",
                    extra={"event": put.key, "bytes": len(put.value), "error": str(exc)},
                )
        return len(chunk)

    async def _trim(self, written: int) -> None:
        """Delete the oldest events past ``keep``; the newest ``keep // 2`` that are not
        refusals stay whatever the refusals did (a flood cannot push them out)."""
        if self._stored is not None:
            self._stored += written
            if self._stored <= self.keep + self.slack:
                return
        entries = (await self.store.range(PREFIX)).entries
        self._stored = len(entries)
        excess = len(entries) - self.keep
        if excess <= 0:
            return
        others = [e.key for e in entries if not _is_refusal(e)]
        kept = set(others[len(others) - self.keep // 2 :]) if self.keep >= 2 else set()
        doomed = [e.key for e in entries if e.key not in kept][:excess]
        for i in range(0, len(doomed), TXN_OPS):
            await self.store.txn([], [Delete(k) for k in doomed[i : i + TXN_OPS]])
        self._stored -= len(doomed)

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
        for event in self._pending:
            if PREFIX + event.id >= low:
                by_id.setdefault(PREFIX + event.id, event)
        ordered = [by_id[k] for k in sorted(by_id)]
        chosen = ordered[-limit:] if limit else []
        return Events(
            events=chosen,
            last_id=chosen[-1].id if chosen else None,
            truncated=len(ordered) > len(chosen),
        )


def _is_refusal(entry: Entry) -> bool:
    kind = _KIND.search(entry.value)
    return kind is None or kind.group(1).decode() in REFUSALS


def _some(ranks: list[int], more: list[int]) -> list[int]:
    """``ranks`` with ``more`` added: sorted, distinct, the lowest ``LIST_ITEMS`` of them."""
    return sorted({*ranks, *more[: LIST_ITEMS + 1]})[:LIST_ITEMS]


def _handshake_detail(f: dict[str, Any]) -> str:
    n = f.get("decode_rank_count", len(f["decode_ranks"]))
    shown = _ranks(f["decode_ranks"]) + (f"… ({n} ranks)" if n > len(f["decode_ranks"]) else "")
    group = f"decode group {f['decode_group_id']!r} " if f.get("decode_group_id") else "decode "
    return (
        f"{group}TP {f['decode_tp_size']} ranks {shown} planned against "
        f"prefill engine {f['engine_id']} (generation {f['generation']}), target ranks "
        f"{_ranks(f['target_ranks'])}"
    )


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:16])) + ("…" if len(ranks) > 16 else "")
