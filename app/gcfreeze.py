"""A growing fleet's long-lived objects out of the cyclic collector's sight.

At start the registry freezes what the store loaded (``gc.freeze()``: a full collection never
walks it again). A fleet that registers afterwards grows the heap the same way: a launch of
100,000 ranks leaves millions of tracked objects (entries, records, briefs, the feed's copy),
nearly all of them kept for the fleet's life, and Python's full collections, each walking all
of them, came every time the heap grew by a quarter: one took 1.0 s on the fleet benchmark's
2-core machine, every request waiting it out (``docs/benchmarks.md``).

So after a collection of the older generations that took ``slow_s`` or more (many objects
survived into them: the heap grew), the next check freezes every object alive, at most once
per ``every_s``. What is frozen is still freed by reference counting, as nearly everything the
registry drops is; only garbage in reference cycles among frozen objects is kept, which
bounds what this costs: at most what was alive in cycles at each freeze, and freezes happen
only while the heap grows.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from app.periodic import every

log = logging.getLogger("app")


class Freezer:
    def __init__(self, slow_s: float = 0.02, every_s: float = 10.0) -> None:
        self.slow_s = slow_s
        self.every_s = every_s
        self.slow = 0  # slow collections since the last freeze
        self.freezes = 0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif info.get("generation", 0) >= 1 and time.perf_counter() - self._started >= self.slow_s:
            self.slow += 1

    def check(self) -> bool:
        """Freeze when a slow collection came since the last check (True if it did)."""
        if not self.slow:
            return False
        slow, self.slow = self.slow, 0
        gc.freeze()
        self.freezes += 1
        log.info(
            "froze the heap's long-lived objects",
            extra={"frozen": gc.get_freeze_count(), "slow_collections": slow},
        )
        return True

    @contextlib.asynccontextmanager
    async def active(self) -> AsyncIterator[None]:
        gc.callbacks.append(self._callback)
        try:
            async with every(self.every_s, self.check, "heap-freezer"):
                yield
        finally:
            gc.callbacks.remove(self._callback)
