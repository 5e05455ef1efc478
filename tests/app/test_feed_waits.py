"""Waits on the watch feed's progress (``Feed.reached``: a node's heartbeat on etcd waits there
for its renewal's revision): each waiter is released when the feed passes its revision, and
only then; a wait that runs out answers False, and so does one the feed's closing ends; ended
waits do not pile up while the feed stands still. A real SQLite store and feed in this
process, changes written through the store (keys of no engine: the feed applies them
without an event)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.store import Put, create_store
from app.watch.feed import DUE_PRUNE_AT
from harness.feeds import registry_with_feed

pytestmark = pytest.mark.store

WAITERS = 300


def test_each_waiter_is_released_when_the_feed_passes_its_revision(tmp_path: Path) -> None:
    async def body() -> None:
        store = create_store(f"sqlite:///{tmp_path / 'r.db'}")
        async with registry_with_feed(store) as (_, feed):
            start = (await store.txn([], [Put("groups/g/note", b"{}")])).revision
            assert await feed.reached(start, 5.0)
            # Waiters on each of the next WAITERS revisions, three apiece, in shuffled order.
            targets = [start + 1 + (i * 7919) % WAITERS for i in range(WAITERS)] * 3
            waits = [asyncio.create_task(feed.reached(r, 30.0)) for r in targets]
            await asyncio.sleep(0)
            for step in range(1, WAITERS + 1):
                done = await store.txn([], [Put(f"groups/g{step % 5}/note", b"{}")])
                assert await feed.reached(done.revision, 5.0)
                await asyncio.sleep(0)  # the released ones run
                released = [r for r, w in zip(targets, waits, strict=True) if w.done()]
                assert all(r <= feed.progress for r in released)
                assert len(released) == sum(1 for r in targets if r <= feed.progress), step
            assert all(w.result() for w in waits)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_wait_that_runs_out_or_that_closing_ends_answers_false(tmp_path: Path) -> None:
    async def body() -> None:
        store = create_store(f"sqlite:///{tmp_path / 'r.db'}")
        async with registry_with_feed(store) as (_, feed):
            ahead = feed.progress + 1_000
            assert await feed.reached(ahead, 0.2) is False
            # Ended waits leave the heap while the feed stands still (no change comes).
            for _ in range(3 * DUE_PRUNE_AT):
                assert await feed.reached(ahead, 0.0) is False
            assert len(feed._due) <= DUE_PRUNE_AT
            held = asyncio.create_task(feed.reached(ahead, 30.0))
            await asyncio.sleep(0.05)
            assert not held.done()
            await feed.close()
            assert await asyncio.wait_for(held, 5.0) is False

    asyncio.run(asyncio.wait_for(body(), 60))
