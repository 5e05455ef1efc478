"""The lease clock on etcd: etcd keeps each lease ``headroom`` seconds past its ttl, and the
replica that served its renewals ends it at its ttl, crediting its own stalls.

etcd expires a lease on the cluster's clock: a heartbeat that reached a replica in time but
waited there (its loop stalled, its process stopped or starved) would find the lease gone,
and a single replica's restart would lapse every lease with less time left than the
restart took. So a lease is granted for its ttl plus ``headroom_s`` (``REGISTRY_LEASE_GRACE_S``),
and the registry's figures are the lease's *logical* time: what etcd says it has left, less
the headroom (``logical``). The replica that granted or renewed a lease ends it (a
``LeaseRevoke``: etcd deletes its keys and the watch says so) once its logical time is out,
by the rules of the SQLite store's lease clock (``app/store/lease_clock.py``):

- it asks etcd first (``LeaseTimeToLive``): a lease renewed through another replica (etcd's
  raft term unchanged since its renewal here) is left to that replica, which sees its own
  stalls, or to etcd's own expiry, until a renewal through this one; one a new leader
  refreshed (a new term) has its clock restarted from etcd's figure;
- a stall of this replica's loop is added to every lease it follows, at most ``headroom_s``
  since the lease's last renewal (``lease_clock.extend``), and a lease that a heartbeat in
  flight reached in time is spared (``lease_clock.sweep_cutoff``).

A lease no live replica follows (its replica was killed or restarted) is ended by etcd itself
at its ttl plus the headroom. So a dead rank is found within its ttl (plus ``interval_s``) while
its replica runs, and within ttl + ``headroom_s`` at most; a lapse means the rank stopped
renewing, unless a replica stalled for longer than the headroom.

Lazy renewals (``REGISTRY_ETCD_RENEW_WINDOW_S`` = W > 0, ``journal.py``): etcd's TTL is the
one clock every replica reads only while every renewal reaches etcd. Renewed in memory with
etcd refreshed every L seconds inside the headroom alone, a lease's etcd deadline trails its
last renewal by up to L (a replica dying just after lapses a live rank unless L < ttl -
interval: one renewal in two saved), and a replica cannot tell from etcd whether another
renewed a lease in memory. So with W the lease is granted W longer, etcd is refreshed about
once per W, and the renewals are shared through the journal, which replaces etcd's figures
here: a lease is ended by the replica that renewed it last (by journal revision), at its
logical expiry with its own stalls credited, after reading the journal up to etcd's
revision of its look (``REACH_S``: else judged next time); one renewed last elsewhere is
left to that replica, and a gone replica's leases are adopted (ended at logical expiry +
headroom). A new leader's refresh only lengthens etcd's deadline and changes nothing.

Every replica must run with the same ``REGISTRY_LEASE_GRACE_S``: a lease's headroom is read
from its granted TTL (``headroom``), and a lease granted with none (ttl not above the
headroom: granted before this rule, or with a grace of 0) is judged on etcd's figure alone.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Awaitable, Callable

from app.store.etcd.journal import Journal
from app.store.lease_clock import (
    ARRIVED,
    CLOCK,
    Credits,
    StoredLease,
    expiry_heap,
    now,
    sweep_cutoff,
)
from app.store.tasks import stop

log = logging.getLogger("app.store")

INTERVAL_S = 0.5  # how often due leases are looked at
ASK_AT_ONCE = 64  # LeaseTimeToLive calls in flight at once


def headroom_s() -> int:
    """Seconds granted past a lease's ttl (``REGISTRY_LEASE_GRACE_S``, rounded up)."""
    return math.ceil(CLOCK.grace_s)


def headroom(granted_ttl: int) -> int:
    """The headroom a lease granted for ``granted_ttl`` seconds holds: none when the TTL is not
    above it (a lease granted before this rule, or with a grace of 0)."""
    room = headroom_s()
    return room if granted_ttl > room else 0


def logical(ttl_left: float, granted_ttl: int) -> float:
    """What a lease has left as the registry counts it, from etcd's figures."""
    return max(0.0, ttl_left - headroom(granted_ttl))


# etcd's figures of a lease now: (TTL left, granted TTL, raft term, store revision); TTL
# left <= 0: etcd no longer has it.
Ask = Callable[[int], Awaitable[tuple[float, int, int, int]]]
REACH_S = 2.0  # how long a reaper waits for the journal to reach etcd's revision
Revoke = Callable[[int], Awaitable[None]]


class Reaper:
    """The leases this replica granted or renewed, each with its logical expiry (on the
    monotonic lease clock), and the task that ends them when it passes."""

    def __init__(self, ask: Ask, revoke: Revoke, interval_s: float = INTERVAL_S) -> None:
        self._ask, self._revoke = ask, revoke
        self.interval_s = interval_s
        self.leases: dict[int, StoredLease] = {}
        self._terms: dict[int, int] = {}  # lease -> etcd's raft term at its renewal here
        self._due: list[tuple[float, int]] = []  # heap; stale items are skipped
        self._credits = Credits()  # this loop's stalls, credited to the leases followed
        self._task: asyncio.Task[None] | None = None
        self.ended = 0  # leases revoked at their logical expiry
        self.graced = False  # a stall was ever credited (readers then add ``grace``)
        self.journal: Journal | None = None  # the renewal journal, when renewals are lazy

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            await stop(self._task)

    def noted(self, lease_id: int, ttl_s: int, remaining_s: float, term: int) -> None:
        """This replica granted or renewed the lease (etcd at raft ``term``):
        ``remaining_s`` of logical time."""
        self._terms[lease_id] = term
        expires_at = now() + remaining_s
        lease = self.leases.get(lease_id)
        if lease is None:
            self.leases[lease_id] = StoredLease(ttl_s, expires_at)
        else:
            lease.ttl_s, lease.expires_at, lease.grace = ttl_s, expires_at, 0.0
        heapq.heappush(self._due, (expires_at, lease_id))
        if len(self._due) > 2 * len(self.leases) + 1024:  # renewals leave stale items
            self._due = expiry_heap(self.leases)

    def adopt(self, lease_id: int, ttl_s: int, expires_at: float) -> None:
        """Follow a lease whose owner is gone (``journal.py``), to end it at ``expires_at``."""
        if lease_id not in self.leases:
            self.leases[lease_id] = StoredLease(ttl_s, expires_at)
            heapq.heappush(self._due, (expires_at, lease_id))

    def forget(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)
        self._terms.pop(lease_id, None)

    def grace(self, lease_id: int) -> float:
        """The stall time credited to the lease since its last renewal here."""
        lease = self.leases.get(lease_id)
        return 0.0 if lease is None else lease.grace

    def credit(self) -> None:
        """Credit the loop's stalls not yet credited to every lease followed."""
        if self._credits.credit(self.leases):
            self._due = expiry_heap(self.leases)
            self.graced = True

    def overdue(self, lease_id: int) -> bool:
        """Whether a renewal arriving now (``ARRIVED``) comes after the lease's time ran out,
        as this replica knows it (another replica may have renewed it since: ``settle``)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        self.credit()
        arrived = ARRIVED.get()
        return lease.expires_at <= (now() if arrived is None else arrived)

    async def settle(self, lease_id: int) -> bool:
        """Judge an overdue lease with etcd's figures now: True when it was ended (the
        renewal that found it so is refused, as the SQLite store refuses a late one)."""
        figures = await self._ask(lease_id)
        if self.journal is not None and not await self.journal.reached(figures[3], REACH_S):
            return False  # a renewal through another replica may be on its way: not ended
        if self._judge(lease_id, *figures):
            await self._revoke(lease_id)
            self.forget(lease_id)
            self.ended += 1
            return True
        return False

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reap()
            except Exception as exc:  # etcd unreachable: etcd's own expiry still bounds it
                if not failing:
                    log.warning(
                        "lease reaper: %s; leases due are tried every %.1f s, and etcd ends "
                        "them at their ttl + REGISTRY_LEASE_GRACE_S meanwhile",
                        exc,
                        self.interval_s,
                    )
                failing = True
            else:
                if failing:
                    log.warning("lease reaper: etcd answers again")
                failing = False

    def _take_due(self, cutoff: float) -> list[int]:
        due: list[int] = []
        while self._due and self._due[0][0] < cutoff:
            at, lease_id = heapq.heappop(self._due)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_at == at:  # else renewed since, or gone
                due.append(lease_id)
        return due

    async def reap(self) -> int:
        """End the followed leases whose logical time ran out (etcd agreeing); how many. On
        a failed call the leases not yet judged stay due (looked at again next time)."""
        self.credit()
        due = self._take_due(sweep_cutoff(now()))
        ended = 0
        try:
            for at in range(0, len(due), ASK_AT_ONCE):
                chunk = due[at : at + ASK_AT_ONCE]
                figures = await asyncio.gather(*(self._ask(i) for i in chunk))
                if self.journal is not None and not await self.journal.reached(
                    max(f[3] for f in figures), REACH_S
                ):  # a renewal through another replica may be on its way: judged next time
                    raise TimeoutError(
                        f"the renewal journal did not reach etcd's revision within {REACH_S} s"
                    )
                gone = [i for i, f in zip(chunk, figures, strict=True) if self._judge(i, *f)]
                await asyncio.gather(*(self._revoke(i) for i in gone))
                for lease_id in gone:
                    self.forget(lease_id)
                ended += len(gone)
                self.ended += len(gone)
        except BaseException:
            for lease_id in due:  # judged ones were pushed again with their new expiry
                lease = self.leases.get(lease_id)
                if lease is not None:
                    heapq.heappush(self._due, (lease.expires_at, lease_id))
            raise
        return ended

    def _judge(
        self, lease_id: int, ttl_left: float, granted_ttl: int, term: int, revision: int = 0
    ) -> bool:
        """True: revoke it now. Else it is followed on with what etcd says it has."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        if ttl_left <= 0:  # etcd ended it already
            self.forget(lease_id)
            return False
        if self.journal is not None:
            return self._judge_journal(lease_id, lease)
        at = now()
        left = ttl_left - headroom(granted_ttl)
        if left > 0 and term == self._terms.get(lease_id):  # renewed through another replica
            # That replica judges it now, crediting its own stalls, which this one cannot see:
            # ended here at its logical time, a heartbeat waiting in that replica's stall
            # would find it gone. So it is left to that replica, or to etcd's own expiry
            # (ttl + headroom) if none renews it, until a renewal through this one.
            lease.grace = 0.0
            expires_at = at + ttl_left
        elif left > 0:  # a new leader (a new raft term) refreshed it: its clock restarts
            self._terms[lease_id] = term
            lease.grace = 0.0
            expires_at = at + left
        else:
            expires_at = at + left + lease.grace  # with the stalls credited to it
            if expires_at < sweep_cutoff(at):  # and no heartbeat in flight reached it in time
                return True
            expires_at = max(expires_at, at + self.interval_s)
        lease.expires_at = expires_at
        heapq.heappush(self._due, (expires_at, lease_id))
        return False

    def _judge_journal(self, lease_id: int, lease: StoredLease) -> bool:
        """With the journal read up to etcd's revision: a lease renewed last through another
        replica is left to it; one of this replica's ends at its own figure."""
        book = self.journal.book if self.journal is not None else None
        known = book.known.get(lease_id) if book is not None else None
        if book is not None and known is not None and known.owner != book.me:
            self.forget(lease_id)
            return False
        if known is not None:  # a renewal there written before this one's: its time too
            lease.expires_at = max(lease.expires_at, known.logical_at + lease.grace)
        at = now()
        if lease.expires_at < sweep_cutoff(at):  # no heartbeat in flight reached it in time
            return True
        lease.expires_at = max(lease.expires_at, at + self.interval_s)
        heapq.heappush(self._due, (lease.expires_at, lease_id))
        return False
