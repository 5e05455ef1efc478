"""The embedded store's leases: granted and renewed in memory, judged on the lease clock.

A renewal and the reads it makes judge a lease at the request's arrival, after crediting any
stall of the registry's loop to every live lease (``app/store/lease_clock.py``). Expiries are
instants of the monotonic lease clock; the file holds them as wall time (``_checkpoint``).
"""

from __future__ import annotations

import heapq

from app.store import lease_clock
from app.store.base import Lease
from app.store.lease_clock import ARRIVED, Credits, StoredLease, expiry_heap
from app.store.sqlite.pending import Pending


class LeasesMixin:
    _leases: dict[int, StoredLease]
    _expiry: list[tuple[float, int]]  # heap; stale items are skipped
    _dirty: set[int]  # leases renewed since their expiry was last written
    _next_lease: int
    _pending: Pending
    _credits: Credits  # the loop's stalls credited to the leases

    async def _usable(self) -> None:
        raise NotImplementedError

    def _now(self) -> float:
        """The instant leases are judged at: now, or the request's arrival (lease_clock.py),
        after any stall of the loop is credited to the leases."""
        now = lease_clock.now()
        if self._credits.due(now):
            self._credit()
        arrived = ARRIVED.get()
        return now if arrived is None else min(now, arrived)

    def _credit(self) -> None:
        """Credit the loop's stalls not yet credited to every live lease."""
        if self._credits.credit(self._leases):
            self._expiry = expiry_heap(self._leases)
            self._dirty.update(self._leases)

    async def grant_lease(self, ttl_s: int) -> Lease:
        await self._usable()
        self._pending.writable()
        lease_id = self._next_lease
        self._next_lease += 1
        expires_at = lease_clock.now() + ttl_s
        self._leases[lease_id] = StoredLease(ttl_s, expires_at)
        heapq.heappush(self._expiry, (expires_at, lease_id))
        # Written with the next change (the transaction that puts keys on it, or the sweep
        # within sweep_interval_s), as renewals are: a key is never durable on a lease that is
        # not, and a registration costs one commit, not two.
        self._dirty.add(lease_id)
        return Lease(lease_id, ttl_s, float(ttl_s))

    async def refresh_lease(self, lease_id: int) -> Lease | None:
        """Renew in memory; the expiry reaches the file with the next commit or sweep, within
        ``sweep_interval_s`` (as etcd checkpoints keep-alives). After a crash a lease may end
        up to that much early: its rank's next heartbeat answers 404 and it registers again."""
        await self._usable()
        judged_at = self._now()  # first: it credits any stall to the lease read below
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= judged_at:  # judged at the arrival
            return None
        lease.expires_at, lease.grace = lease_clock.now() + lease.ttl_s, 0.0
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        self._dirty.add(lease_id)
        return Lease(lease_id, lease.ttl_s, float(lease.ttl_s))

    def _checkpoint(self) -> list[tuple[int, int, float]]:
        """The leases renewed since last written, with their expiries as wall time."""
        dirty, self._dirty = self._dirty, set()
        leases = ((i, self._leases.get(i)) for i in dirty)
        wall = lease_clock.to_wall(0.0)
        return [(i, ls.ttl_s, ls.expires_at + wall) for i, ls in leases if ls is not None]

    async def lease_remaining(self, leases: set[int]) -> dict[int, float]:
        now = lease_clock.now()
        return {
            i: (lease.expires_at - now if (lease := self._leases.get(i)) else 0.0) for i in leases
        }
