"""The renewal journal: leases renewed in memory, shared by every replica (issue 51).

With ``REGISTRY_ETCD_RENEW_WINDOW_S`` = W > 0, an etcd lease is granted for ttl + headroom + W
(headroom: ``REGISTRY_LEASE_GRACE_S``) and a renewal reaches etcd only when etcd's deadline,
as this replica knows it, would fall below the lease's new logical expiry + headroom +
``SLACK_S``: about once per W. Every other renewal is made in memory and written here:

- **The journal.** Each replica owns one key, ``groups.\\x7frenewed/<replica id>``
  (``PREFIX``), on a presence lease of its own (TTL: the headroom, kept alive every
  ``presence_every_s``). Once a tick (``TICK_S``, shorter at a faster pace: about
  ``LEASES_A_WRITE`` leases a write), when it renewed or granted anything, it puts there
  (lease id, ttl, logical seconds left, etcd seconds left) for each lease since its last
  write. Every replica watches the prefix from its start, in revision order, and notes each
  entry (``Book``): the lease's owner (the replica that renewed it last, by journal
  revision), its logical expiry and etcd's deadline, both on its own clock.
- **A renewal's revision.** An in-memory renewal answers with the revision of the first
  journal write begun after the request arrived (``revision_after``): a write after the
  request, so a read at that revision is one made after it, as a renewal's revision on
  etcd was (``Lease.watched``: the registry's watch feed gets there without asking etcd for
  progress). A renewal that did reach etcd answers with etcd's revision.
- **Who ends a lease.** Its owner, at its logical expiry plus the stalls the owner credits
  (``reaper.py``); a replica that sees another's newer entry leaves the lease to it. When a
  replica's presence key is deleted (it died, or stopped past the headroom), the live
  replica with the least id adopts its leases and ends each at its logical expiry + headroom.
  Before ending a lease a reaper reads the journal up to etcd's revision of its last look
  (``reached``): a renewal through another replica is never missed.
- **Readers** answer from the journal; a lease no entry was seen for (this replica started
  after its last renewal) is taken as etcd's TTL left less the headroom: never shorter than
  its logical time, at most W longer.

A journal that lost history (its watch compacted past) forgets what it knew: readers fall
back to etcd's figures and the leases followed here are left to etcd's own expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd import rpc
from aetcd.utils import prefix_range_end

from app.store.base import Compacted, KeyChange, Unavailable
from app.store.etcd import watch as etcd_watch
from app.store.lease_clock import now
from app.store.tasks import stop

log = logging.getLogger("app.store")

# Inside the registry feed's watch (``app/watch/feed.py``: ``groups/`` from its fence
# ``groups.`` on, ``watch.py``) and outside every read of ``groups/``: each journal write is
# an event on the feed's stream, so it proves the feed's progress to its revision, and a
# heartbeat answered at that revision needs no fence of its own.
PREFIX = "groups.\x7frenewed/"
MARK = "groups.\x7frenewed"  # the journal's keys and its watch's fence start so
TICK_S = 0.05  # at most one write a tick: a renewal waits for the next write, ≤ a tick
# The tick shortens with the pace, to about this many leases a write, down to ``MIN_TICK_S``:
# a busy replica's renewals wait less, and a quiet one writes at most once a ``TICK_S``. A
# write costs the replica about the same CPU whatever it holds (an etcd call alone, 0.6-0.9 ms
# here, gRPC's threads included; ``bench.etcd_calls``): at 1,250 renewals a second, 40 a write
# (a 32 ms tick, 31 writes a second) took 3-22% less of the replica's CPU than 20 (49 writes;
# 4 pairs, median 7%) and a quarter less of etcd's, for a heartbeat p99 of 40-45 ms, not 29-35.
LEASES_A_WRITE = 40
MIN_TICK_S = 0.02
PROGRESS_S = 5.0  # a quiet journal watch asks etcd for progress this often
SLACK_S = 2.0  # etcd is refreshed this long before strictly needed
MS = 1000.0
_ENTRY = struct.Struct("<qIII")  # lease id, ttl s, logical ms left, etcd ms left
PENDING = 1 << 62  # the revision of a renewal here not yet written

Call = Callable[[str, Callable[[aetcd.Client, float], Awaitable[Any]]], Awaitable[Any]]


def _ms(seconds: float) -> int:
    return min(round(max(0.0, seconds) * MS), 0xFFFFFFFF)  # 49 days at most


def pack(rows: Iterable[tuple[int, int, float, float]]) -> bytes:
    return b"".join(_ENTRY.pack(i, ttl, _ms(a), _ms(b)) for i, ttl, a, b in rows)


def unpack(value: bytes) -> Iterator[tuple[int, int, float, float]]:
    for i, ttl, a, b in _ENTRY.iter_unpack(value[: len(value) - len(value) % _ENTRY.size]):
        yield i, ttl, a / MS, b / MS


def tick_at(rate: float) -> float:
    """The tick for ``rate`` leases renewed a second: ``LEASES_A_WRITE`` a write, within
    ``MIN_TICK_S``..``TICK_S``."""
    return min(TICK_S, max(MIN_TICK_S, LEASES_A_WRITE / max(rate, 1e-3)))


def in_journal(prefix: str) -> bool:
    """Whether a read of ``prefix`` may see the journal's keys (they are not the store's)."""
    return MARK.startswith(prefix) or prefix.startswith(MARK)


def journal_key(key: str) -> bool:
    return key.startswith(MARK)


@dataclass(slots=True)
class Known:
    """One lease as the journal says: who renewed it last, at which journal revision, and its
    logical expiry and etcd's deadline (a lower bound when known here) on this clock."""

    owner: str
    ttl_s: int
    logical_at: float
    etcd_at: float
    revision: int
    adopted: bool = False


class Book:
    """What this replica knows of the leases renewed anywhere; no I/O."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.known: dict[int, Known] = {}
        self.pending: set[int] = set()
        self.revoked: set[int] = set()  # ended here, to be written (ttl 0)
        self.alive: set[str] = {me}

    def renewed_here(self, lease_id: int, ttl_s: int, etcd_at: float) -> None:
        at = now()
        known = self.known.get(lease_id)
        if known is None:
            self.known[lease_id] = Known(self.me, ttl_s, at + ttl_s, etcd_at, PENDING)
        else:
            known.owner, known.ttl_s, known.logical_at = self.me, ttl_s, at + ttl_s
            known.etcd_at, known.revision = max(known.etcd_at, etcd_at), PENDING
            known.adopted = False
        self.pending.add(lease_id)

    def forget(self, lease_id: int) -> None:
        self.known.pop(lease_id, None)
        self.pending.discard(lease_id)

    def ended(self, lease_id: int) -> None:
        """Revoked here: forgotten, and written so that every replica forgets it."""
        self.forget(lease_id)
        self.revoked.add(lease_id)

    def remaining(self, lease_id: int) -> float | None:
        known = self.known.get(lease_id)
        return None if known is None else max(0.0, known.logical_at - now())

    def take(self) -> tuple[list[int], bytes]:
        """The leases to write now, and the value that says them."""
        leases, self.pending = list(self.pending), set()
        at = now()
        rows = [
            (i, k.ttl_s, k.logical_at - at, k.etcd_at - at)
            for i in leases
            if (k := self.known.get(i)) is not None
        ]
        rows += [(i, 0, 0.0, 0.0) for i in self.revoked]
        self.revoked = set()
        return leases, pack(rows)

    def written(self, leases: list[int], revision: int | None) -> None:
        """A write of ``leases`` landed at ``revision`` (None: it failed, write them again)."""
        for i in leases:
            known = self.known.get(i)
            if known is None or known.revision != PENDING or i in self.pending:
                continue
            if revision is None:
                self.pending.add(i)
            else:
                known.revision = revision

    def heard(self, owner: str, revision: int, value: bytes) -> list[int]:
        """Another replica's entry at ``revision``; the leases it took from this one (or
        revoked: a row of ttl 0)."""
        self.alive.add(owner)
        at = now()
        moved: list[int] = []
        for lease_id, ttl_s, logical_left, etcd_left in unpack(value):
            known = self.known.get(lease_id)
            if not ttl_s:
                if known is not None:
                    moved.append(lease_id)
                self.forget(lease_id)
                continue
            if known is None:
                self.known[lease_id] = Known(
                    owner, ttl_s, at + logical_left, at + etcd_left, revision
                )
                continue
            known.etcd_at = max(known.etcd_at, at + etcd_left)
            # Renewed there, written before the renewal here was: not later than its time.
            known.logical_at = max(known.logical_at, at + logical_left)
            if revision > known.revision:  # renewed there after its last renewal here
                if known.owner == self.me:
                    moved.append(lease_id)
                known.owner, known.ttl_s, known.revision = owner, ttl_s, revision
                known.adopted = False
        return moved

    def left(self, owner: str) -> list[int]:
        """``owner``'s presence is gone: the leases of gone replicas this one adopts now (it
        is the live replica with the least id)."""
        self.alive.discard(owner)
        if owner == self.me or min(self.alive | {self.me}) != self.me:
            return []
        adopted = [
            i for i, k in self.known.items() if k.owner != self.me and k.owner not in self.alive
        ]
        for i in adopted:
            known = self.known[i]
            known.owner, known.adopted = self.me, True
        return adopted

    def prune(self, horizon_s: float) -> None:
        """Drop what ran out ``horizon_s`` ago (etcd has ended it by then)."""
        at = now()
        self.known = {
            i: k
            for i, k in self.known.items()
            if i in self.pending or max(k.logical_at, k.etcd_at) + horizon_s > at
        }


class Journal:
    """This replica's journal: its writes, its presence, and its watch of every replica's."""

    def __init__(
        self,
        call: Call,
        root: bytes,
        presence_ttl_s: int,
        horizon_s: float,
        moved: Callable[[list[int]], None],
        adopt: Callable[[list[int]], None],
        lost: Callable[[], None],
    ) -> None:
        self.me = secrets.token_hex(8)
        self.book = Book(self.me)
        self._call, self._root = call, root
        self._key = root + (PREFIX + self.me).encode()
        self._presence_ttl = presence_ttl_s
        self.presence_every_s = max(1.0, presence_ttl_s / 4)
        self._horizon_s = horizon_s
        self._moved, self._adopt, self._lost = moved, adopt, lost
        self._presence = 0  # the presence lease; 0: none yet (or lost)
        self._presence_at = 0.0
        self.delivered = 0  # the journal's watch has applied every change up to this
        self._progressed: asyncio.Future[None] | None = None
        self._nudge = asyncio.Event()
        self._wake = asyncio.Event()
        self._next: asyncio.Future[int] | None = None  # the next write's revision
        self._writing: tuple[float, asyncio.Future[int]] | None = None  # (began, revision)
        self._written = (float("-inf"), 0)  # the last write landed: (began, revision)
        self._tasks: list[asyncio.Task[None]] = []
        self.writes = 0
        self.presence_kept = 0  # the presence lease's renewals sent to etcd
        self.rate = 0.0  # leases written a second, smoothed
        self.tick_s = TICK_S

    async def start(self) -> None:
        """Read who is alive (the keys there), then write and follow from that revision."""
        key = self._root + PREFIX.encode()
        request = rpc.RangeRequest(key=key, range_end=prefix_range_end(key), keys_only=True)
        reply = await self._call("read", lambda c, t: c.kvstub.Range(request, timeout=t))
        cut = len(key)
        self.book.alive |= {bytes(kv.key)[cut:].decode() for kv in reply.kvs}
        self.delivered = int(reply.header.revision)
        await self._new_presence()
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._writer())]

    async def close(self) -> None:
        """Its watch and writer ended (``stop``: the watch loops on ``wait_for``)."""
        await asyncio.gather(*(stop(task) for task in self._tasks))

    # -- writing ---------------------------------------------------------------------------

    def renewed(self, lease_id: int, ttl_s: int, etcd_at: float) -> None:
        """Granted or renewed here (etcd keeps it until ``etcd_at`` at least): written next
        tick."""
        self.book.renewed_here(lease_id, ttl_s, etcd_at)
        self._wake.set()

    def ended(self, lease_id: int) -> None:
        self.book.ended(lease_id)
        self._wake.set()

    async def revision_after(self, arrived: float, seconds: float) -> int:
        """The revision of a journal write begun at ``arrived`` or later: the last one
        landed, else the one under way, else the next (a request's later renewals share
        its first one's)."""
        if self._written[0] >= arrived:  # a write after the request's arrival landed
            return self._written[1]
        writing = self._writing
        if writing is not None and writing[0] >= arrived:
            done = writing[1]
        else:
            if self._next is None:
                self._next = self._due_within(TICK_S + seconds)
            done = self._next
            self._wake.set()
        return await asyncio.shield(done)

    def _due_within(self, seconds: float) -> asyncio.Future[int]:
        """The next write's revision, failed if no write landed within ``seconds``: one
        deadline (a timer) for every renewal that waits for it, where each had its own, never
        later than any waiter's own."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def overdue() -> None:
            if not done.done():
                done.set_exception(
                    Unavailable(
                        f"the renewal journal wrote nothing within {seconds:g} s: etcd is slow "
                        "or unreachable"
                    )
                )
                done.exception()  # retrieved: its waiters raise their own

        timer = loop.call_later(seconds, overdue)
        done.add_done_callback(lambda _: timer.cancel())
        return done

    async def _writer(self) -> None:
        last = -TICK_S
        failing = False
        while True:
            wait = self._presence_at + self.presence_every_s - now()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wait))
            self._wake.clear()
            await asyncio.sleep(max(0.0, last + self.tick_s - now()))
            elapsed, last = now() - last, now()
            try:
                if now() - self._presence_at >= self.presence_every_s:
                    await self._keep_presence()
                if self.book.pending or self.book.revoked or self._next is not None:
                    self._pace(len(self.book.pending), elapsed)
                    await self._write()
                if self.writes % 256 == 0:
                    self.book.prune(self._horizon_s)
            except Exception as exc:  # etcd unreachable: renewals wait, then fail alone
                if not failing:
                    log.warning(
                        "renewal journal: %s; tried again each tick (%g-%g s)",
                        exc,
                        MIN_TICK_S,
                        TICK_S,
                    )
                failing = True
            else:
                if failing:
                    log.warning("renewal journal: written again")
                failing = False

    def _pace(self, leases: int, elapsed: float) -> None:
        """The next tick, from the leases written a second."""
        self.rate = 0.8 * self.rate + 0.2 * leases / max(elapsed, MIN_TICK_S)
        self.tick_s = tick_at(self.rate)

    async def _write(self) -> None:
        leases, value = self.book.take()
        done = self._next or asyncio.get_running_loop().create_future()
        self._next = None
        began = now()
        self._writing = (began, done)
        try:
            revision = await self._put(value)
        except BaseException as exc:
            self.book.written(leases, None)
            if not done.done():  # (past its deadline it failed already)
                done.set_exception(Unavailable(f"the renewal journal's write failed: {exc!r}"))
                done.exception()  # retrieved: its waiters raise their own
            raise
        finally:
            self._writing = None
        self.writes += 1
        self._written = (began, revision)
        self.book.written(leases, revision)
        if not done.done():
            done.set_result(revision)

    async def _put(self, value: bytes) -> int:
        for _ in range(2):
            if not self._presence:
                await self._new_presence()
            put = rpc.PutRequest(key=self._key, value=value, lease=self._presence)

            async def send(client: aetcd.Client, seconds: float, put: Any = put) -> int:
                try:
                    reply = await client.kvstub.Put(put, timeout=seconds)
                except rpc.AioRpcError as exc:
                    if exc.code() != rpc.StatusCode.NOT_FOUND:  # its presence lease is gone
                        raise
                    return 0
                return int(reply.header.revision)

            revision: int = await self._call("journal", send)
            if revision:
                return revision
            self._presence = 0  # it expired (a stall past the headroom): a new one
        raise Unavailable("the renewal journal's presence lease expired as soon as granted")

    async def _new_presence(self) -> None:
        request = rpc.LeaseGrantRequest(TTL=self._presence_ttl)
        granted = await self._call(
            "lease grant", lambda c, t: c.leasestub.LeaseGrant(request, timeout=t)
        )
        self._presence, self._presence_at = int(granted.ID), now()

    async def _keep_presence(self) -> None:
        if not self._presence:
            await self._new_presence()
            return
        at = now()
        lease = self._presence

        async def renew(client: aetcd.Client, seconds: float) -> int:
            stream = client.leasestub.LeaseKeepAlive(timeout=seconds)
            try:
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease))
                await stream.done_writing()
                return int((await stream.read()).TTL)
            finally:
                stream.cancel()

        self.presence_kept += 1
        if await self._call("lease refresh", renew) <= 0:
            self._presence = 0  # gone: the next write grants a new one
        self._presence_at = at

    # -- following -------------------------------------------------------------------------

    async def reached(self, revision: int, seconds: float) -> bool:
        """Whether the journal's watch applied every entry up to ``revision`` within
        ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.delivered < revision:
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._progressed is None or self._progressed.done():
                self._progressed = loop.create_future()
            self._nudge.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._progressed), left)
        return True

    async def _follow(self) -> None:
        while True:
            try:
                changes = etcd_watch.follow(
                    self._call, self._root, PREFIX, self.delivered + 1, PROGRESS_S, self._nudge
                )
                async for batch in changes:
                    for change in batch.changes:
                        self._apply(change)
                    self.delivered = max(self.delivered, batch.revision)
                    if self._progressed is not None and not self._progressed.done():
                        self._progressed.set_result(None)
            except Compacted as exc:
                log.warning("renewal journal: history compacted (%s); starting over", exc)
                self.book.known = {i: self.book.known[i] for i in self.book.pending}
                self._lost()
                self.delivered = exc.oldest - 1
            except Exception as exc:  # the stream broke: open it again from where it was
                log.warning("renewal journal watch: %s; opened again", exc)
                await asyncio.sleep(TICK_S)

    def _apply(self, change: KeyChange) -> None:
        owner = change.key[len(PREFIX) :]
        if change.entry is None:
            if owner == self.me:
                self._presence = 0
            else:
                adopted = self.book.left(owner)
                if adopted:
                    self._adopt(adopted)
        elif owner != self.me:
            moved = self.book.heard(owner, change.entry.mod_revision, change.entry.value)
            if moved:
                self._moved(moved)
