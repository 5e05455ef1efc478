"""The app's lifespan: it owns the store, and what reads it (the registry, its watch feed and
the watch streams) lives from the store's start to its close."""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI

from app.core.gcfreeze import Freezer
from app.core.metrics import Metrics
from app.registry import Registry
from app.security.tokens import TokenSource
from app.server.settings import Settings
from app.store import Store, create_store
from app.watch.feed import Feed
from app.watch.stream import Watchers

log = logging.getLogger("app")

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def watch_limit(settings: Settings) -> int:
    """``watch_max``, else half the connections the descriptor limit leaves room for (no
    floor: the other half is always the requests')."""
    if settings.watch_max is not None:
        return settings.watch_max
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, min(settings.max_connections, soft - 64) // 2)


def lifespan(
    settings: Settings, metrics: Metrics, tokens: TokenSource, store: Store | None = None
) -> Lifespan:
    """The lifespan for ``FastAPI(lifespan=...)``: ``store``, else one made from
    ``settings.store``, started, and closed last."""

    @contextlib.asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        owned = store or create_store(
            settings.store,
            timeout_s=settings.store_timeout_s,
            sweep_interval_s=settings.sweep_interval_s,
            etcd=settings.etcd_access(),
        )
        try:
            await owned.start()
        except Exception as exc:
            log.error("cannot start: %s", exc, extra={"store": owned.description})
            raise
        # What the store loaded (every entry and lease of the file) lives as long as the
        # process: out of the collector's sight, a full collection never walks it again.
        gc.freeze()
        app.state.registry = registry = Registry(
            owned, metrics, settings.events_keep, settings.blob_codec
        )
        feed = Feed(
            owned,
            registry.decoded,
            keep=settings.watch_history,
            keep_bytes=settings.watch_history_bytes,
            progress_s=min(1.0, settings.watch_bookmark_s),
        )
        feed.start()
        registry.seen = feed  # heartbeats on etcd, the status page and /metrics read from it
        app.state.watchers = Watchers(
            feed,
            metrics,
            max_watchers=watch_limit(settings),
            budget_bytes=settings.watch_send_budget_bytes,
            bookmark_s=settings.watch_bookmark_s,
        )
        log.info("registry serving", extra={"store": owned.description})
        try:
            async with tokens.watching(), Freezer().active():
                yield
        finally:
            await app.state.watchers.close()
            await feed.close()
            await registry.events.close()
            await owned.close()

    return serving
