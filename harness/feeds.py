"""A registry in this process with its watch feed, as ``app.main`` wires them, for tests that
call the registry directly on a real store."""

from __future__ import annotations

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
