"""What the etcd store keeps in process, with no I/O: what it knows of leases, and what its
shared watches have seen. ``app.store.etcd.store`` does the talking."""

from __future__ import annotations

import asyncio
import time


class LeaseBook:
    """What leases have left, as this replica knows it. A lease this store granted or renewed
    is known until it runs out: only a renewal through another replica could change that, and
    only by adding time, so the figure is a lower bound. One learned by asking etcd is known
    for ``cache_s`` (default: a third of its TTL, the renewal period)."""

    def __init__(self, cache_s: float | None = None) -> None:
        self.cache_s = cache_s
        # lease id → (monotonic time until which it is known, monotonic expiry as known)
        self._known: dict[int, tuple[float, float]] = {}

    def remaining(self, lease: int) -> float | None:
        """Seconds the lease has left, or None when it must be asked."""
        now = time.monotonic()
        known = self._known.get(lease)
        return max(0.0, known[1] - now) if known is not None and now < known[0] else None

    def granted(self, lease: int, remaining: float | None) -> None:
        """This store granted or renewed it (None: it is gone)."""
        self._note(lease, remaining, remaining)

    def asked(self, lease: int, remaining: float, granted_ttl: int) -> None:
        trust = self.cache_s if self.cache_s is not None else granted_ttl / 3
        # Out of time but kept by etcd (the headroom): a heartbeat may yet renew it.
        self._note(lease, remaining, trust if remaining > 0 else min(trust, 1.0))

    def _note(self, lease: int, remaining: float | None, trust_s: float | None) -> None:
        if remaining is None or trust_s is None:
            self._known.pop(lease, None)
            return
        now = time.monotonic()
        if len(self._known) > 50_000:  # bounded: drop the expired ones
            self._known = {k: v for k, v in self._known.items() if v[1] > now}
        self._known[lease] = (now + trust_s, now + remaining)


class WatchHub:
    """One watch on a top-level key segment (``groups/``) serving every waiter on any prefix
    under it: a waiter costs no RPC, and a burst of waiters no burst of watches. Changes are
    dispatched in revision order; a prefix is tracked from the first revision not yet
    dispatched when its first waiter came."""

    def __init__(self, start: int, index: int) -> None:
        loop = asyncio.get_running_loop()
        self.index = index  # the endpoint it watches through
        self.progress = start - 1  # every change up to this revision has been dispatched
        self.since: dict[str, int] = {}  # prefix → first revision tracked for it
        self.latest: dict[str, int] = {}  # prefix → revision of its last change seen
        self.changed: dict[str, asyncio.Future[None]] = {}
        self.opened: asyncio.Future[None] = loop.create_future()
        self.dead: asyncio.Future[None] = loop.create_future()
        self.task: asyncio.Task[None] | None = None

    def track(self, prefix: str) -> int:
        """Follow ``prefix``; returns the first revision whose changes it will see."""
        if prefix not in self.since:
            if len(self.since) > 100_000:  # bounded: a forgotten prefix only wakes once
                self.since.clear()
                self.latest.clear()
            self.since[prefix] = self.progress + 1
        return self.since[prefix]

    def next_change(self, prefix: str) -> asyncio.Future[None]:
        return self.changed.setdefault(prefix, asyncio.get_running_loop().create_future())

    def dispatch(self, key: str, revision: int) -> None:
        self.progress = revision
        for i in range(len(key) + 1):
            if key[:i] in self.since:
                self.latest[key[:i]] = revision
                waiting = self.changed.pop(key[:i], None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)

    def end(self) -> None:
        if not self.dead.done():
            self.dead.set_result(None)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
