"""What the etcd store keeps beside its calls: what it knows of leases, what its shared
watches have seen, and its one lease keep-alive stream per endpoint. ``app.store.etcd`` makes
the calls and bounds each with its deadline."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any


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
        self._note(lease, remaining, self.cache_s if self.cache_s is not None else granted_ttl / 3)

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


class KeepAliveStream:
    """One LeaseKeepAlive stream carrying every renewal through one endpoint (a stream per
    renewal costs twice the CPU). etcd answers a stream's requests in order, so an answer
    goes to the oldest renewal waiting for its lease. A failed or interrupted write ends the
    stream (its waiters fail, and retry on a fresh one): the order must never slip."""

    def __init__(self, call: Any, request: Any) -> None:
        self.call = call  # LeaseKeepAlive, without a deadline: it lives with the store
        self.request = request  # the LeaseKeepAliveRequest message type
        self.waiting: dict[int, deque[asyncio.Future[Any]]] = {}
        self.lock = asyncio.Lock()
        self.broken = False
        self.reader = asyncio.create_task(self._read())

    async def renew(self, lease_id: int, seconds: float) -> Any:
        async with asyncio.timeout(seconds):
            async with self.lock:  # cancelled while waiting here: nothing written, no harm
                if self.broken:
                    raise ConnectionError("the lease keep-alive stream to etcd ended")
                answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                self.waiting.setdefault(lease_id, deque()).append(answer)
                try:
                    await self.call.write(self.request(ID=lease_id))
                except BaseException as exc:  # failed or cut mid-write: the order may slip
                    self.close()
                    if isinstance(exc, Exception):
                        raise ConnectionError(
                            f"the lease keep-alive stream ended: {exc!r}"
                        ) from exc
                    raise
            return await asyncio.shield(answer)

    async def _read(self) -> None:
        try:
            while True:
                reply = await self.call.read()
                if not hasattr(reply, "ID"):  # end of stream
                    return
                queue = self.waiting.get(reply.ID)
                if queue:
                    answer = queue.popleft()
                    if not queue:
                        del self.waiting[reply.ID]
                    if not answer.done():
                        answer.set_result(reply)
        except Exception:  # the waiters learn of it below
            pass
        finally:
            self.close()

    def close(self) -> None:
        self.broken = True
        for queue in self.waiting.values():
            for answer in queue:
                if not answer.done():
                    answer.set_exception(ConnectionError("the lease keep-alive stream ended"))
                    answer.exception()  # retrieved: renew raises it to its caller
        self.waiting.clear()
        if self.reader is not asyncio.current_task():
            self.reader.cancel()
        self.call.cancel()
