"""app/gcfreeze.py: a slow collection of the older generations makes the next check freeze
the heap; no slow collection, no freeze."""

from __future__ import annotations

import asyncio
import gc

import pytest

from app.gcfreeze import Freezer

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
