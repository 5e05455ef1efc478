"""The embedded store's loading and failures: memory loaded from the file at start, and again
after a failed commit (see ``app.store.sqlite.store``)."""

from __future__ import annotations

import asyncio
import logging
import time

from sortedcontainers import SortedList

from app.store import lease_clock
from app.store.base import Entry, Unavailable
from app.store.lease_clock import StoredLease, expiry_heap, extend, last_served
from app.store.sqlite.file import FileFailure, FileLocked, Loaded
from app.store.sqlite.history import History
from app.store.sqlite.pending import Pending
from app.store.sqlite.thread import FileThread
from app.store.waiters import Waiters

log = logging.getLogger("app.store")

CLOSED = "The SQLite store is closed (the service is shutting down)."


class RecoveryMixin:
    _thread: FileThread
    _timeout_s: float
    _kv: dict[str, Entry]
    _reloads: int
    _keys: SortedList[str]
    _leases: dict[int, StoredLease]
    _expiry: list[tuple[float, int]]
    _dirty: set[int]
    _revision: int
    _next_lease: int
    _pending: Pending
    _history: History
    _waiters: Waiters
    _loaded: bool
    _failure: FileFailure | None
    _refused_since: float | None  # the store answers 503 since (lease clock)
    _recovering: asyncio.Lock
    _closed: bool
    _sweeper: asyncio.Task[None] | None

    async def _sweep(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Load the file (refusing one another process serves) and start the lease sweeper."""
        try:
            await self._recover()
        except Unavailable as exc:
            if isinstance(exc.__cause__, FileLocked):
                raise exc.__cause__ from None
            log.error("SQLite store not loaded; answering 503", extra={"error": exc.detail})

    def _install(self, loaded: Loaded) -> None:
        held, self._dirty = self._leases, set()
        self._kv = {e.key: e for e in loaded.entries}
        self._reloads += 1
        self._keys = SortedList(e.key for e in loaded.entries)
        wall, now = time.time(), lease_clock.now()
        self._leases = {
            i: StoredLease(ttl, exp - wall + now) for i, (ttl, exp) in loaded.leases.items()
        }
        for entry in loaded.entries:
            if entry.lease is not None and entry.lease in self._leases:
                self._leases[entry.lease].keys.add(entry.key)
        served = last_served(self._leases)
        if not self._loaded and served is not None and served < now:
            # A restart is a stall: the leases' clock stopped while no process served them.
            extend(self._leases, served, now - served)
            self._dirty = set(self._leases)
        if self._loaded:  # a reload after a failed commit
            self._keep_renewals(held)
            # Its failed revisions are issued again: the history records them when durable.
            self._history.rewind(loaded.revision)
        else:
            self._history.reset(loaded.revision)
        self._expiry = expiry_heap(self._leases)
        self._revision = loaded.revision
        self._next_lease = max(self._next_lease, loaded.next_lease)  # no id issued twice
        self._pending.clear()
        self._loaded, self._failure = True, None

    def _keep_renewals(self, held: dict[int, StoredLease]) -> None:
        """After a reload: a renewal answered before it holds (the file may lack it), and
        the time the store refused to serve is a stall of every lease's clock."""
        for lease_id, lease in self._leases.items():
            mine = held.get(lease_id)
            if mine is not None and mine.expires_at > lease.expires_at:
                lease.expires_at, lease.grace = mine.expires_at, mine.grace
                self._dirty.add(lease_id)
        self._credit_refusal()

    def _credit_refusal(self) -> None:
        since, self._refused_since = self._refused_since, None
        if since is not None and extend(self._leases, since, lease_clock.now() - since):
            self._expiry = expiry_heap(self._leases)
            self._dirty.update(self._leases)

    async def _recover(self) -> None:
        """(Re)load memory from the file: at start, and after a failed commit."""
        if self._closed:
            raise Unavailable(CLOSED)
        began = lease_clock.now()  # a request refused: refused since it asked
        async with self._recovering:
            if self._loaded and self._failure is None:
                return
            if self._failure is not None and self._failure.permanent:
                raise Unavailable(self._failure.detail)
            if self._loaded and self._revision == self._history.durable:
                await self._resume(began)
                return
            try:
                loaded = await self._thread.call(self._thread.file.load, self._timeout_s)
            except FileFailure as exc:
                self._fail(exc)
                self._refusing(began)
                raise Unavailable(exc.detail) from exc
            except (FileLocked, Unavailable) as exc:
                self._refusing(began)
                if isinstance(exc, Unavailable):
                    raise
                raise Unavailable(str(exc)) from exc
            recovered = self._failure is not None
            self._install(loaded)
            if recovered:
                log.warning("SQLite store recovered: reloaded from the file")
                self._waiters.wake_all()
        if self._sweeper is None and not self._closed:
            self._sweeper = asyncio.create_task(self._sweep())

    async def _resume(self, began: float) -> None:
        """Only renewals failed to reach the file (every revision is durable): memory is the
        file plus them, so the file thread takes commits again without a reload (100,000
        agents of 1.5 KiB, 12,500 leases: 0.6-0.9 s on the file's thread and 0.2 s on the loop
        a reload, every sweep of a full disk's outage), and every lease is written with the
        next commit."""
        try:
            await self._thread.call(self._thread.resume, self._timeout_s)
        except Unavailable:
            self._refusing(began)
            raise
        self._failure = None
        self._dirty = set(self._leases)
        self._credit_refusal()

    def _refusing(self, began: float) -> None:
        """A request that began at ``began`` is refused (503), heartbeats too: the leases'
        clock stops from then until the store serves again (``_credit_refusal``)."""
        if self._loaded and self._refused_since is None:
            self._refused_since = began

    def _fail(self, failure: FileFailure) -> None:
        if self._failure is None or (failure.permanent and not self._failure.permanent):
            log.error("SQLite store failed", extra={"error": failure.detail})
        if self._failure is None or not self._failure.permanent:
            self._failure = failure

    async def _usable(self) -> None:
        if self._closed:  # closing: nothing answered now could reach the file
            raise Unavailable(CLOSED)
        if self._failure is not None or not self._loaded:
            await self._recover()
