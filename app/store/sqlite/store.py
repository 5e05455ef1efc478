"""The embedded store: every entry and lease in memory, made durable in one SQLite file.

One registry process owns the file (an exclusive ``flock``; a second process refuses to
start), so memory is the truth and reads never touch SQLite: a ``get`` or ``range`` is a
dictionary lookup on the event loop, with no thread hop and nothing that a stalled disk can
block. A write is decided in memory (compares, leases), applied there, and handed to the
file's thread, which commits the changes of every request waiting at that moment in one
transaction (group commit); the request answers only after its change is in the WAL.

A reader never sees what is not yet durable: reading a key whose latest change is on its way
to the file waits for that commit (bounded by the store timeout). A failed commit (full or
read-only disk) fails the changes after it, the store answers 503 naming the cause, and the
next request reloads memory from the file, which recovers once the disk does. The reload keeps
every renewal already answered (memory's later expiry wins; written once the disk takes it)
and issues the failed revisions again; where only renewals failed there is nothing to reload.
The time the store refused to serve is credited to the leases, as a stall. A file deleted or
replaced under the process stops the store for good, loudly (checked before every commit and
sweep). Leases run on the monotonic lease clock, persisted as wall-clock instants, so a lease
outlives a restart with its remaining time intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList

from app.store import lease_clock
from app.store.base import Compare, Entry, Op, Put, Snapshot, Store, TxnResult, Unavailable
from app.store.lease_clock import (
    Credits,
    StoredLease,
    sweep_cutoff,
)
from app.store.sqlite.file import Change, FileFailure, FileLocked, SqliteFile
from app.store.sqlite.history import History
from app.store.sqlite.leases import LeasesMixin
from app.store.sqlite.pending import Pending
from app.store.sqlite.recovery import RecoveryMixin
from app.store.sqlite.thread import FileThread
from app.store.waiters import Waiters

if TYPE_CHECKING:
    from app.store.base import ChangeBatch

log = logging.getLogger("app.store")

__all__ = ["FileLocked", "SqliteStore"]


class SqliteStore(RecoveryMixin, LeasesMixin, Store):
    def __init__(
        self,
        path: str | Path,
        *,
        timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        sweep_interval_s: float = 1.0,
        max_pending: int = 20_000,
        history: int = 10_000,
    ) -> None:
        self.path = str(path)
        self.description = f"sqlite:///{self.path}"
        self._timeout_s = timeout_s
        self._sweep_interval_s = sweep_interval_s
        synchronous = synchronous.upper()
        if synchronous not in {"NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be NORMAL, FULL or EXTRA, not {synchronous!r}")
        self._thread = FileThread(
            SqliteFile(self.path, synchronous=synchronous, timeout_s=timeout_s)
        )
        self._kv: dict[str, Entry] = {}
        # the changes to _kv by the key's top segment, and its reloads (memory_version)
        self._changes: dict[str, int] = {}
        self._reloads = 0
        # For prefix ranges; a list's insort moved every later key (64 us a key at 200,000).
        self._keys: SortedList[str] = SortedList()
        self._leases: dict[int, StoredLease] = {}
        self._expiry: list[tuple[float, int]] = []  # heap; stale items are skipped
        self._revision = 0
        self._next_lease = 1
        self._pending = Pending(self.path, timeout_s, max_pending)
        self._thread.on_settled = self._pending.wake
        # Leases renewed since their expiry was last written (see refresh_lease).
        self._dirty: set[int] = set()
        self._loaded = False
        self._failure: FileFailure | None = None
        self._refused_since: float | None = None  # the store answers 503 since (lease clock)
        self._recovering = asyncio.Lock()  # bound to a loop on first use (Python >= 3.10)
        self._waiters = Waiters()
        self._history = History(history)
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._credits = Credits()  # the loop's stalls credited to the leases (lease_clock.py)

    # -- memory ------------------------------------------------------------------------------

    def _alive(self, entry: Entry, now: float) -> bool:
        if entry.lease is None:
            return True
        lease = self._leases.get(entry.lease)
        return lease is not None and lease.expires_at > now

    def memory_version(self, segment: str) -> int | None:
        if self._failure is not None or not self._loaded:
            return None
        return self._reloads + self._changes.get(segment, 0)  # both only grow: never repeats

    def _changed(self, key: str) -> None:
        segment = key.partition("/")[0]
        self._changes[segment] = self._changes.get(segment, 0) + 1

    def _set(self, entry: Entry) -> None:
        self._changed(entry.key)
        old = self._kv.get(entry.key)
        if old is None:
            self._keys.add(entry.key)
        elif (
            old.lease is not None
            and old.lease != entry.lease
            and (lease := self._leases.get(old.lease)) is not None
        ):
            lease.keys.discard(entry.key)
        if entry.lease is not None:
            self._leases[entry.lease].keys.add(entry.key)
        self._kv[entry.key] = entry

    def _remove(self, key: str) -> bool:
        old = self._kv.pop(key, None)
        if old is None:
            return False
        self._changed(key)
        self._keys.remove(key)
        if old.lease is not None and (lease := self._leases.get(old.lease)) is not None:
            lease.keys.discard(key)
        return True

    def _under(self, prefix: str) -> list[str]:
        return list(self._keys.irange(prefix, prefix + "\U0010ffff", inclusive=(True, False)))

    def _drop_lease(self, lease_id: int, change: Change) -> list[str]:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return []
        keys = sorted(lease.keys)
        for key in keys:
            self._remove(key)
        change.deletes.extend(keys)
        change.lease_deletes.append(lease_id)
        return keys

    # -- durability --------------------------------------------------------------------------

    def _persist(self, change: Change, keys: Iterable[str]) -> asyncio.Future[None]:
        if self._dirty:
            change.lease_puts.extend(self._checkpoint())
        fut = self._thread.commit(change)
        self._pending.track(fut, keys, self._fail)
        if change.revision > self._history.recorded:  # a new revision (else renewals only)
            self._history.record(change, fut)
        return fut

    def _write_renewals(self) -> asyncio.Future[None]:
        """A commit of no new revision: the renewals made since the last write (``_persist``
        adds them to any commit)."""
        return self._persist(Change(self._revision, self._next_lease), ())

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str, *, settled: bool = True) -> Entry | None:
        await self._usable()
        if settled and key in self._pending.keys:
            await self._pending.settle_keys([key])
        entry = self._kv.get(key)
        return entry if entry is not None and self._alive(entry, self._now()) else None

    def peek(self, keys: Sequence[str]) -> list[Entry | None] | None:
        if self._failure is not None or not self._loaded or not self._pending.settled(keys):
            return None
        now = self._now()
        return [e if (e := self._kv.get(k)) and self._alive(e, now) else None for k in keys]

    async def range(self, prefix: str, *, settled: bool = True) -> Snapshot:
        await self._usable()
        if settled:
            await self._pending.settle_prefix(prefix)
        now = self._now()
        entries = [e for k in self._under(prefix) if self._alive(e := self._kv[k], now)]
        remaining = {
            e.lease: self._leases[e.lease].expires_at - now for e in entries if e.lease is not None
        }
        return Snapshot(entries, self._revision, remaining, read_at=lease_clock.to_wall(now))

    # -- writes ------------------------------------------------------------------------------

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        await self._usable()
        self._pending.writable()
        now = self._now()
        for cmp in compares:
            entry = self._kv.get(cmp.key)
            current = entry.mod_revision if entry is not None and self._alive(entry, now) else 0
            if current != cmp.mod_revision:
                return TxnResult(False, self._revision)
        for op in ops:
            if isinstance(op, Put) and op.lease is not None:
                lease = self._leases.get(op.lease)
                if lease is None or lease.expires_at <= now:
                    return TxnResult(False, self._revision)
        self._revision += 1
        change = Change(self._revision, self._next_lease)
        for op in ops:
            if isinstance(op, Put):
                change.puts.append(entry := Entry(op.key, op.value, self._revision, op.lease))
                self._set(entry)
            else:
                keys = self._under(op.key) if op.prefix else [op.key]
                change.deletes.extend(key for key in keys if self._remove(key))
        changed = [entry.key for entry in change.puts] + change.deletes
        fut = self._persist(change, changed)
        self._waiters.notify(changed)
        await self._pending.durable(fut)
        return TxnResult(True, change.revision)

    def _end_leases(self, lease_ids: Iterable[int]) -> list[str]:
        """Drop the leases and their keys in one change; the keys that went."""
        self._revision += 1
        change = Change(self._revision, self._next_lease)
        keys = [k for lease_id in lease_ids for k in self._drop_lease(lease_id, change)]
        # Not awaited: readers of these keys wait for the commit themselves.
        self._persist(change, keys)
        self._waiters.notify(keys)
        return keys

    async def revoke_lease(self, lease_id: int) -> None:
        await self._usable()
        if lease_id in self._leases:
            self._end_leases([lease_id])

    async def purge_expired(self) -> int:
        """Delete expired leases and their entries now (waking waiters); how many keys went."""
        await self._usable()
        self._now()  # any stall credited first
        now = sweep_cutoff(lease_clock.now())
        expired: list[int] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                expired.append(lease_id)
        if not expired:
            if self._dirty:  # write the renewals of the last interval
                self._write_renewals()
            return 0
        expired = list(dict.fromkeys(expired))  # a renewed lease may be due twice in the heap
        gone = [self._kv[k] for i in expired if (ls := self._leases.get(i)) for k in ls.keys]
        ended = len(self._end_leases(expired))
        tell = self.on_expired
        if tell is not None and gone:
            try:
                tell(gone)
            except Exception:  # the sweeper must go on
                log.exception("lease expiries not told")
        return ended

    async def _sweep(self) -> None:
        """Purge expired leases (so waiters wake and the file stays small) and notice a
        database file deleted or replaced under us, even when no write comes."""
        while not self._closed:
            await asyncio.sleep(self._sweep_interval_s)
            try:
                self._thread.file.check_identity()
                if self._loaded and self._failure is None:
                    await self.purge_expired()
            except FileFailure as exc:
                self._fail(exc)
            except Unavailable:
                continue

    # -- waiting -----------------------------------------------------------------------------

    async def wait(self, prefix: str, after_revision: int, timeout_s: float) -> bool:
        await self._usable()
        if any(self._kv[k].mod_revision > after_revision for k in self._under(prefix)):
            return True
        return await self._waiters.wait(prefix, timeout_s)

    async def changes(
        self,
        prefix: str,
        start_revision: int,
        progress_s: float,
        nudge: asyncio.Event | None = None,
    ) -> AsyncIterator[ChangeBatch]:
        """From the bounded history of durable changes (``sqlite_history``)."""
        await self._usable()
        async for batch in self._history.follow(
            prefix, start_revision, progress_s, lambda: self._closed
        ):
            yield batch

    # -- lifecycle ---------------------------------------------------------------------------

    async def ping(self) -> None:
        """A real write to the file, so readiness fails whenever writes would."""
        await self._usable()
        try:
            await self._thread.call(self._thread.file.probe, self._timeout_s)
        except FileFailure as exc:
            self._fail(exc)
            raise Unavailable(exc.detail) from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._dirty and self._loaded and self._failure is None:
            # The renewals answered since the last sweep reach the file before it closes: a
            # restart then credits its downtime from them, not from a second earlier.
            written = self._write_renewals()
            with contextlib.suppress(Unavailable, FileFailure, TimeoutError):
                await asyncio.wait_for(asyncio.shield(written), self._timeout_s)
        self._waiters.wake_all()
        self._history.wake()
        await self._thread.stop(self._timeout_s)

    def stats(self) -> dict[str, Any]:
        kv, leases, pending = len(self._kv), len(self._leases), self._pending.inflight
        return {"keys": kv, "leases": leases, "pending": pending}
