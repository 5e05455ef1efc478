"""Changes of the SQLite store on their way to the file, and the waits for them.

The store decides every change in memory and hands it to the file's thread (group commit).
Until its commit returns, a change is *pending*: readers of its keys wait for it (a reader
never sees what a crash could still take back), writers wait for their own, and too many
pending changes refuse new writes (a stalled disk must not grow memory without bound).

Commits land in order, so the latest pending change under a key, or under a "directory" (a
key's prefix up to a ``/``), stands for every earlier one there: once it is durable, they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from app.store.base import Unavailable
from app.store.sqlite.file import FileFailure

_Item = tuple[int, "asyncio.Future[None]"]  # (sequence, its commit)


class Pending:
    def __init__(self, path: str, timeout_s: float, max_pending: int) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.keys: dict[str, _Item] = {}
        self.dirs: dict[str, _Item] = {}
        self.inflight = 0
        self._seq = 0
        self._deadlines: list[tuple[float, asyncio.Future[None]]] = []
        self._waiters: dict[asyncio.Future[None], list[asyncio.Future[None]]] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        # How often the watchdog looks: a small share of the timeout, at most 0.1 s.
        self._period = min(0.1, max(timeout_s / 50, 0.005))

    def clear(self) -> None:
        self.keys.clear()
        self.dirs.clear()
        self.inflight = 0

    def writable(self) -> None:
        if self.inflight >= self.max_pending:
            raise Unavailable(
                f"SQLite store {self.path}: {self.inflight} changes wait for the disk "
                "(stalled or too slow); refusing more until it catches up."
            )

    def track(
        self,
        fut: asyncio.Future[None],
        keys: Iterable[str],
        on_failure: Callable[[FileFailure], None],
    ) -> None:
        """``fut`` commits a change to ``keys``; forget it once it settles."""
        self._seq += 1
        item = (self._seq, fut)
        self.inflight += 1
        touched = list(keys)
        dirs = {d for key in touched for d in _dirs(key)}
        for key in touched:
            self.keys[key] = item
        for d in dirs:
            self.dirs[d] = item

        def done(f: asyncio.Future[None]) -> None:
            self.inflight -= 1
            for key in touched:
                if self.keys.get(key, (0, None))[1] is f:
                    del self.keys[key]
            for d in dirs:
                if self.dirs.get(d, (0, None))[1] is f:
                    del self.dirs[d]
            if not f.cancelled() and isinstance(exc := f.exception(), FileFailure):
                on_failure(exc)

        fut.add_done_callback(done)

    async def durable(self, fut: asyncio.Future[None], deadline: float | None = None) -> None:
        """Wait for ``fut``'s commit, until ``deadline`` (monotonic) or the store's timeout.

        Each waiter awaits a future of its own (cancelling a waiter must not cancel a commit
        others wait for), woken by :meth:`wake` as soon as the file's thread settles the
        commit (in the same turn of the loop, not one callback later), and one watchdog timer
        ends the waits past their deadline (within ``_period``): no timer per wait."""
        if not fut.done():
            loop = fut.get_loop()  # the commit's: no get_running_loop() (a getpid() each)
            waiter = loop.create_future()
            waiters = self._waiters.get(fut)
            if waiters is None:
                self._waiters[fut] = [waiter]
            else:
                waiters.append(waiter)
            self._deadlines.append(
                (time.monotonic() + self.timeout_s if deadline is None else deadline, waiter)
            )
            if self._watchdog is None:
                self._watchdog = loop.call_later(self._period, self._expire)
            try:
                await waiter
            except TimeoutError:
                raise Unavailable(
                    f"SQLite store {self.path} did not commit within {self.timeout_s:g} s "
                    "(a stalled or overloaded disk); the change may still take effect."
                ) from None
        if not fut.cancelled() and isinstance(exc := fut.exception(), FileFailure):
            raise Unavailable(exc.detail) from exc

    def wake(self, futs: Iterable[asyncio.Future[None]]) -> None:
        """Commits settled (the file thread's hand-back, on the loop): wake their waiters."""
        for fut in futs:
            for waiter in self._waiters.pop(fut, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _expire(self) -> None:
        now = time.monotonic()
        waiting = []
        for when, waiter in self._deadlines:
            if waiter.done():
                continue
            if when <= now:
                waiter.set_exception(TimeoutError())
            else:
                waiting.append((when, waiter))
        self._deadlines = waiting
        if not waiting:  # commits whose waiters all left: forget them
            self._waiters = {f: w for f, w in self._waiters.items() if not f.done()}
        self._watchdog = (
            asyncio.get_running_loop().call_later(self._period, self._expire) if waiting else None
        )

    def settled(self, keys: Iterable[str]) -> bool:
        """None of ``keys`` has a change on its way to the file."""
        pending = self.keys
        return not pending or not any(key in pending for key in keys)

    async def settle_keys(self, keys: Iterable[str]) -> None:
        """Wait until none of ``keys`` has a change on its way to the file."""
        keys = list(keys)
        deadline = time.monotonic() + self.timeout_s
        waited: _Item | None = None
        while True:
            latest: _Item | None = None
            for key in keys:
                item = self.keys.get(key)
                if item is not None and (latest is None or item[0] > latest[0]):
                    latest = item
            if latest is None or latest is waited:
                # (``waited``: committed, its bookkeeping callback has yet to run; waiting on
                # it again would return at once, never yielding to the loop that runs it)
                return
            await self.durable(latest[1], deadline)  # raises if it failed
            waited = latest

    async def settle_prefix(self, prefix: str) -> None:
        """Wait until nothing under ``prefix`` is on its way to the file."""
        if not self.keys:
            return
        if not prefix.endswith("/"):
            await self.settle_keys([k for k in self.keys if k.startswith(prefix)])
            return
        deadline = time.monotonic() + self.timeout_s
        while (item := self.dirs.get(prefix)) is not None:
            await self.durable(item[1], deadline)  # raises if it failed
            if self.dirs.get(prefix) is item:
                return  # committed; its bookkeeping callback has yet to run


_PARENTS: dict[str, list[str]] = {}  # a key's parent "directory" -> its dirs (few: groups)
_PARENTS_KEPT = 4096  # a memo of live groups' parents; every group ever seen would be 40 MB


def _dirs(key: str) -> list[str]:
    """``a/b/c`` -> ``a/``, ``a/b/`` (cached by the key's parent: a group's keys share it)."""
    parent = key[: key.rfind("/") + 1]
    dirs = _PARENTS.get(parent)
    if dirs is None:
        if len(_PARENTS) >= _PARENTS_KEPT:
            _PARENTS.clear()
        dirs = _PARENTS[parent] = _split(parent)
    return dirs


def _split(key: str) -> list[str]:
    out = []
    i = key.find("/")
    while i >= 0:
        out.append(key[: i + 1])
        i = key.find("/", i + 1)
    return out
