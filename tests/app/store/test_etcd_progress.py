"""Progress on etcd's watch is proven by the watch's own events (``app/store/etcd/watch.py``).

etcd 3.4.23 (Debian's, which these tests run) answers a requested progress notification ahead
of the events it covers (etcd issue 15220): every time when the watch starts behind etcd's
head. Taken as progress, it let the watch feed, a list or a watch start past changes not yet
applied, and miss them for good. And the queue between gRPC and the reader is bounded: a
reader that lags holds the stream back instead of growing memory.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from app.store import ChangeBatch, Put, Snapshot
from harness.etcd import SKIP_REASON, etcd_available
from harness.feeds import registry_with_feed
from tests.app.store.conftest import shared_etcd

pytestmark = [
    pytest.mark.store,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON),
]
aetcd = pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")

from app.store.etcd.store import EtcdStore  # noqa: E402

TRIES = 40
DEADLINE_S = 10.0


def run(body: Coroutine[Any, Any, None]) -> None:
    asyncio.run(body)


def new_store() -> EtcdStore:
    return EtcdStore.from_url(shared_etcd().url(f"progress-{uuid.uuid4().hex}"), timeout_s=5.0)


async def skips_progress(store: EtcdStore, prefix: str) -> bool:
    """Write six changes under ``prefix``, start a watch after the first (behind etcd's head,
    as the feed's watch starts after its list when writes land in between), ask for progress
    at once, and read until the last change: whether a progress batch passed a change that
    came after it."""
    first = await store.txn([], [Put(prefix + "a", b"0")])
    last = first.revision
    for i in range(5):
        last = (await store.txn([], [Put(f"{prefix}k{i}", b"x")])).revision
    nudge = asyncio.Event()
    stream = store.changes(prefix, first.revision + 1, 1.0, nudge)
    nudge.set()  # a reader waits for the feed (a heartbeat, a list page)
    progress = 0
    skipped = False
    try:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                batch = await anext(stream)
                if not batch.changes:
                    progress = max(progress, batch.revision)
                    continue
                skipped = skipped or batch.revision <= progress
                if batch.revision >= last:
                    return skipped
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def test_progress_never_passes_a_change_still_on_its_way() -> None:
    async def body() -> None:
        store = new_store()
        try:
            skips = [await skips_progress(store, f"t{i}/") for i in range(TRIES)]
        finally:
            await store.close()
        assert sum(skips) == 0, f"progress passed a change not yet delivered in {sum(skips)}"

    run(body())


class WritesAfterItsList(EtcdStore):
    """An etcd store whose read of a prefix is followed by writes to one group before it
    answers: the feed's watch then starts behind etcd's head, as it does when a fleet writes
    while a replica starts."""

    async def entries(self, prefix: str) -> Snapshot:
        snap = await super().entries(prefix)
        for rank in range(5):
            await self.txn([], [Put(f"groups/g1/agents/{rank:05d}", b"{}")])
        await self.txn([], [Put("elsewhere", b"x")])  # a change outside the feed's prefix
        return snap


def test_a_feed_that_reached_a_revision_shows_every_change_up_to_it() -> None:
    """A list right after a replica starts (``caught_up``: the store's revision, then the feed
    there) shows every write answered before it; fences show nowhere."""

    async def once() -> tuple[int, set[str]]:
        store = WritesAfterItsList.from_url(
            shared_etcd().url(f"feed-{uuid.uuid4().hex}"), timeout_s=5.0
        )
        async with registry_with_feed(store) as (_, feed):
            await feed.caught_up(DEADLINE_S)
            seen = len(feed.groups.get("g1", {}))
            assert set(feed.groups) <= {"g1"}  # no group of a fence
            assert list(feed.log.events) == []  # keys of no engine: no event
            listed = await store.entries("groups/")
            assert {e.key.split("/")[1] for e in listed.entries} == {"g1"}
            return seen, {e.key for e in listed.entries}

    async def body() -> None:
        short = 0
        for _ in range(10):
            seen, keys = await once()
            assert len(keys) == 5
            short += seen < 5
        assert short == 0, f"the feed had passed writes it had not applied in {short} of 10"

    run(body())


async def take_until(stream: AsyncIterator[ChangeBatch], revision: int) -> list[ChangeBatch]:
    got: list[ChangeBatch] = []
    async with asyncio.timeout(DEADLINE_S):
        while not got or got[-1].revision < revision or got[-1].changes:
            got.append(await anext(stream))
    return got


def test_a_lagging_reader_holds_the_stream_back_and_a_nudge_still_gets_through() -> None:
    from app.store.etcd.watch import Inbox, follow

    async def body() -> None:
        store = new_store()
        inbox = Inbox(4)
        nudge = asyncio.Event()
        try:
            start = await store.txn([], [Put("b/start", b"0")])
            stream = follow(
                store._call, store._root, "b/", start.revision + 1, 5.0, nudge, inbox=inbox
            )
            try:
                opened = asyncio.ensure_future(anext(stream))
                await asyncio.sleep(0.2)  # the stream is open, its watch synced: a response a write
                writes = [(await store.txn([], [Put(f"b/{i}", b"x")])).revision for i in range(60)]
                first = await asyncio.wait_for(opened, DEADLINE_S)
                await asyncio.sleep(0.5)  # the reader lags: nothing taken
                assert inbox.peak <= 4, f"{inbox.peak} responses queued past the bound of 4"
                nudge.set()  # a nudge must not wait for room, nor be lost
                rest = await take_until(stream, writes[-1])
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        finally:
            await store.close()
        changed = [b.revision for b in [first, *rest] if b.changes]
        assert changed == writes  # every change, in order, none lost by the wait
        assert rest[-1].revision >= writes[-1]  # the nudge's answer: progress
        assert not rest[-1].changes
        assert inbox.peak <= 4

    run(body())


def test_the_fence_key_sorts_just_before_the_prefix() -> None:
    from app.store.etcd.watch import fence_key

    assert fence_key(b"/registry/groups/") == b"/registry/groups."
    assert b"/registry/groups." < b"/registry/groups/" < b"/registry/groups/a"
    with pytest.raises(ValueError, match="last byte"):
        fence_key(b"")


def test_a_progress_request_never_answered_is_followed_by_a_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd 3.4.25-3.4.30 and 3.5.8-3.5.12 answer no progress request on a new watch until an
    event comes (etcd issue 17507): a quiet stream must still report progress, not fail.
    Here the request is one etcd ignores (a watch request of no kind)."""
    from aetcd import rpc

    from app.store.etcd import watch as etcd_watch

    monkeypatch.setattr(etcd_watch, "PROGRESS_REQUEST", rpc.WatchRequest())

    async def body() -> None:
        store = new_store()
        try:
            start = await store.txn([], [Put("q/x", b"0")])
            other = await store.txn([], [Put("elsewhere", b"1")])
            stream = store.changes("q/", start.revision + 1, 0.3)
            try:
                async with asyncio.timeout(DEADLINE_S):
                    quiet = await anext(stream)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        finally:
            await store.close()
        assert quiet.changes == ()
        assert quiet.revision > other.revision  # the fence's

    run(body())
