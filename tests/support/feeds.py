"""A registry in this process with its watch feed, as ``app.main`` wires them, for tests that
call the registry directly on a real store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from app.registry import Registry
from app.store import Store
from app.watch.feed import Feed


@asynccontextmanager
async def registry_with_feed(store: Store) -> AsyncIterator[tuple[Registry, Feed]]:
    """Start ``store``, a registry on it and its feed (loaded within 5 s); close both after."""
    await store.start()
    registry = Registry(store)
    feed = Feed(store, registry.decoded)
    feed.start()
    registry.seen = feed
    try:
        await feed.ready(5.0)
        yield registry, feed
    finally:
        await feed.close()
        await store.close()


async def shows(feed: Feed, gid: str, keys: int, timeout_s: float = 5.0) -> None:
    """Wait until ``feed`` shows at least ``keys`` keys of group ``gid``.

    ``feed.reached(store.revision())`` is not enough on etcd 3.4.23 (Debian's, which the tests
    run): etcd answers a requested progress notification out of band of the watch's events
    (etcd issue 15220, fixed in later releases), so a feed may hear of a revision a few
    milliseconds before the events up to it arrive (seen here 1 time in 40 right after a
    feed started; docs/operations.md)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(feed.groups.get(gid, {})) < keys:
        if loop.time() > deadline:
            raise AssertionError(f"the feed did not show {keys} keys of {gid!r} in {timeout_s} s")
        await asyncio.sleep(0.01)
