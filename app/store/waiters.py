"""Waits on key prefixes, woken by the keys a change touched: a change wakes the waiters of
each of its keys' ``/``-ending prefixes and of the key itself, by dictionary lookups (not a
scan of every waiter: thousands of ranks hold ``wait_ready`` during a launch storm)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class Waiters:
    def __init__(self) -> None:
        self._by_prefix: dict[str, set[asyncio.Future[None]]] = {}

    def notify(self, keys: Iterable[str]) -> None:
        if not self._by_prefix:
            return
        touched = list(keys)
        for key in touched:
            cut = 0
            while True:
                self._wake(self._by_prefix.pop(key[:cut], ()))
                slash = key.find("/", cut)
                if slash < 0:
                    break
                cut = slash + 1
            self._wake(self._by_prefix.pop(key, ()))
        # Prefixes that do not end at a "/" (none in this service, allowed by the API).
        for prefix in [p for p in self._by_prefix if p and not p.endswith("/")]:
            if any(k.startswith(prefix) for k in touched):
                self._wake(self._by_prefix.pop(prefix))

    def wake_all(self) -> None:
        waiting, self._by_prefix = self._by_prefix, {}
        for futs in waiting.values():
            self._wake(futs)

    @staticmethod
    def _wake(futs: Iterable[asyncio.Future[None]]) -> None:
        for fut in futs:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, prefix: str, timeout_s: float) -> bool:
        """True once a key under ``prefix`` changed, False when ``timeout_s`` passed first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._by_prefix.setdefault(prefix, set()).add(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if (futs := self._by_prefix.get(prefix)) is not None:
                futs.discard(fut)
                if not futs:
                    del self._by_prefix[prefix]
