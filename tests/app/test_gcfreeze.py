"""app/core/gcfreeze.py: a slow collection of the older generations makes the next check freeze
the heap; no slow collection, no freeze."""

from __future__ import annotations

import asyncio
import gc

import pytest

from app.core.gcfreeze import Freezer

pytestmark = pytest.mark.unit


def test_a_slow_collection_freezes_the_heap_at_the_next_check_only() -> None:
    gc.unfreeze()
    freezer = Freezer(slow_s=3600.0, every_s=0.05)  # nothing this process does is that slow

    async def scenario() -> tuple[bool, bool, int, int]:
        async with freezer.active():
            gc.collect(1)
            quiet = freezer.check()
            freezer.slow_s = 0.0  # now every collection of generation 1 or 2 counts as slow
            kept = [[i] for i in range(50_000)]  # long-lived objects, as a launch leaves
            gc.collect(1)
            await asyncio.sleep(0.2)  # the freezer's own task checks within every_s
            frozen = gc.get_freeze_count()
            freezer.slow_s = 3600.0
            freezer.check()  # whatever counted during the sleep
            gc.collect(1)  # not slow now
            again = freezer.check()
            return quiet, again, frozen, len(kept)

    try:
        quiet, again, frozen, kept = asyncio.run(scenario())
    finally:
        gc.unfreeze()
    assert quiet is False
    assert freezer.freezes >= 1
    assert frozen >= kept  # the lists kept alive are among the frozen objects
    assert again is False
    assert freezer._callback not in gc.callbacks  # removed on leaving


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_slow_young_collection_that_freed_nothing_makes_the_next_one_start_frozen() -> None:
    gc.unfreeze()
    gc.disable()  # only the collections this test asks for
    freezer = Freezer(slow_s=0.0, every_s=3600.0)  # slow_s 0: every collection counts as slow
    gc.callbacks.append(freezer._callback)
    try:
        kept = [[i] for i in range(50_000)]  # long-lived objects, as a launch leaves
        gc.collect(1)  # slow, freed nothing: the heap grows
        assert freezer.early == 0
        more = [[i] for i in range(50_000)]
        before = gc.get_freeze_count()
        freezer.slow_s = 3600.0  # the frozen collection is quick, as it is in a launch
        gc.collect(1)  # starts by freezing; walks nothing
        assert freezer.early == 1
        assert gc.get_freeze_count() >= before + len(more)
        gc.collect(1)  # the one after runs for real (not slow now): no freeze
        assert freezer.early == 1
        freezer.slow_s = 0.0
        _Cycle()  # garbage in a cycle: the next collection frees it
        gc.collect(1)
        gc.collect(1)  # so no freeze at this one's start
        assert freezer.early == 1
        assert len(kept) == len(more)
    finally:
        gc.callbacks.remove(freezer._callback)
        gc.enable()
        gc.unfreeze()


def test_a_freeze_does_not_walk_the_frozen_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze's log line counts freezes: ``gc.get_freeze_count()`` walks every frozen
    object (at 100,000 ranks millions, tens of ms on the event loop at each freeze)."""
    counted: list[int] = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or 0)
    freezer = Freezer(slow_s=3600.0, every_s=3600.0)
    freezer.slow = 1  # a slow collection came since the last check
    try:
        assert freezer.check() is True
    finally:
        gc.unfreeze()
    assert freezer.freezes == 1
    assert counted == []
