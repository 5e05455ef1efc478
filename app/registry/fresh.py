"""Reads answered from the replica's watch feed where a store's reads are round trips (etcd).

A handshake, an engine's resolution (``GET /engines/{id}``) and a group's engine read on etcd
each took linearizable Range reads: the engine's index, the group, one per target blob (ten
for a decode rank of TP 1 against a prefill of TP 8). The feed holds every group's entries as
of its ``progress``; such a read is answered from it once it is known to be current:

- ``Heads.after_now`` gives a revision the store had reached at some instant after the
  request arrived: one linearizable read of the store's revision, shared by every request that
  asked before it was sent (one in flight at a time: under load, one a round trip);
- the feed must reach that revision within ``FRESH_WAIT_S`` (else the store is read, as
  before). Its entries at a progress at or past it are the store's at an instant between the
  request's arrival and now: what a linearizable read could have answered. Leases are judged
  as a range read judges them (``Store.lease_remaining``: a key whose lease's time is out is
  not shown);
- ``blobs/`` is not in the feed: a blob is written and deleted with its agent in one
  transaction, so the agent's ``mod_revision`` names the blob's version, whose base64 text
  ``Decoded`` keeps; a text not kept is read (the group's blobs, one range read) and used only
  when its revision is the agent's;
- ``engines/{id}`` is not in the feed either: an engine id's group never changes (the index is
  written once, deleted with the group), so ``EngineGroups`` learns it from the feed's engines
  and from the store's index reads. An engine the feed does not show as its group's current
  one (superseded, deleted, never issued) is resolved by the store's reads, which say why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from app.registry import keys
from app.registry.records import Decoded, EngineRecord
from app.store import Entry, Store, Unavailable

# How long a read waits for the feed to reach the store's revision before it reads the store.
# The feed lags a write by a watch event (about a millisecond); a revision past the last change
# under ``groups/`` (an event's write) is proven by a progress request and, when etcd's answer
# does not prove it, a fence (``app/store/etcd/watch.py``: 50 ms).
FRESH_WAIT_S = 1.0
SCAN_EVERY_S = 1.0  # the feed's engines scanned for an unknown engine id at most this often
ENGINES_KEPT = 200_000  # engine ids whose group is remembered, before the memory starts over


class Heads:
    """The store's revision, read for callers that asked before the read was sent."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._next: asyncio.Future[int] | None = None
        self._sending: asyncio.Task[None] | None = None
        self.reads = 0  # revision reads sent

    async def after_now(self) -> int:
        """A revision the store had reached at some instant after this call began."""
        upcoming = self._next
        if upcoming is None:
            upcoming = self._next = asyncio.get_running_loop().create_future()
            if self._sending is None:
                self._sending = asyncio.create_task(self._send())
        try:
            return await asyncio.shield(upcoming)
        except Unavailable as exc:
            raise Unavailable(exc.detail) from exc  # each caller its own

    async def _send(self) -> None:
        """One read at a time; the callers that came while it was out share the next one."""
        answer: asyncio.Future[int] | None = None
        try:
            while self._next is not None:
                answer, self._next = self._next, None  # sent: later callers wait for the next
                self.reads += 1
                try:
                    answer.set_result(await self._store.revision())
                except Unavailable as exc:
                    _fail(answer, exc)
        finally:  # cancelled (or a bug): no caller waits for ever
            self._sending = None
            cut = Unavailable(
                "The registry's read of the store's revision was cut off (shutting down?): "
                "retry the request."
            )
            for waiting in (answer, self._next):
                if waiting is not None and not waiting.done():
                    _fail(waiting, cut)
            self._next = None


def _fail(answer: asyncio.Future[int], exc: Unavailable) -> None:
    answer.set_exception(exc)
    answer.exception()  # retrieved: each caller raises its own


class EngineGroups:
    """The group each engine id was issued to, as far as this replica has learned it."""

    def __init__(self) -> None:
        self._groups: dict[str, str] = {}
        self._scanned = -SCAN_EVERY_S
        self._engines: dict[str, Entry] = {}  # each group's engine entry as last scanned

    def group(
        self, engine_id: str, groups: Mapping[str, Mapping[str, Entry]], decoded: Decoded
    ) -> str | None:
        """``engine_id``'s group, learned before or from a scan of the feed's ``groups``
        (at most once per ``SCAN_EVERY_S``); None when not known."""
        gid = self._groups.get(engine_id)
        if gid is None and time.monotonic() - self._scanned >= SCAN_EVERY_S:
            self._scanned = time.monotonic()
            if len(self._groups) + len(groups) > ENGINES_KEPT:
                self._groups.clear()
                self._engines.clear()
            engines = self._engines
            for group_id, entries in groups.items():
                entry = entries.get(keys.engine(group_id))
                if entry is not None and entry is not engines.get(group_id):  # a new one
                    engines[group_id] = entry
                    self._groups[decoded.record(entry, EngineRecord).engine_id] = group_id
            gid = self._groups.get(engine_id)
        return gid

    def learn(self, engine_id: str, gid: str) -> None:
        """The store's index said so (``engines/{engine_id}``)."""
        if len(self._groups) >= ENGINES_KEPT:
            self._groups.clear()
        self._groups[engine_id] = gid
