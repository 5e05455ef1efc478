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

The middle generation pays the same way while the heap grows: each of its collections, every
2-3 s in a launch, walked the 100,000-odd objects a few hundred groups left since the last one,
for 64-155 ms, and freed nothing. So a collection of generation 1 that took ``slow_s`` or more
and freed nothing makes the next one start by freezing the heap (it then walks nothing); the
one after runs for real and decides again. Half those pauses go, and what a freeze can keep is
bounded as above: it follows a collection that found no garbage at all.

A freeze is one splice of the collector's lists; counting what is frozen is not:
``gc.get_freeze_count()`` walks every frozen object (55 ms for 6 million on the 2-core
machine, on the event loop's thread), so the freeze's log line counts freezes, not objects.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from app.core.periodic import every

log = logging.getLogger("app")


class Freezer:
    def __init__(self, slow_s: float = 0.02, every_s: float = 10.0) -> None:
        self.slow_s = slow_s
        self.every_s = every_s
        self.slow = 0  # slow collections since the last freeze
        self.freezes = 0
        self.early = 0  # freezes at the start of a collection of generation 1
        self._growing = False  # the last one of those was slow and freed nothing
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        generation = info.get("generation", 0)
        if phase == "start":
            if generation == 1 and self._growing:
                self._growing = False
                gc.freeze()
                self.early += 1
            self._started = time.perf_counter()
            return
        slow = time.perf_counter() - self._started >= self.slow_s
        if generation >= 1 and slow:
            self.slow += 1
        if generation == 1:
            self._growing = slow and info.get("collected", 0) == 0

    def check(self) -> bool:
        """Freeze when a slow collection came since the last check (True if it did)."""
        if not self.slow:
            return False
        slow, self.slow = self.slow, 0
        gc.freeze()
        self.freezes += 1
        log.info(
            "froze the heap's long-lived objects",
            extra={
                "freezes": self.freezes,
                "slow_collections": slow,
                "frozen_early": self.early,
            },
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
