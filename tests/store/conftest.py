"""The store under test. Every contract test runs once per backend listed in ``BACKENDS``;
a backend's factory yields a fresh, empty store (a real file, a real server)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from app.store import Store
from app.store.sqlite import SqliteStore

StoreFactory = Callable[[Path], AbstractAsyncContextManager[Store]]


@asynccontextmanager
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Store]:
    store = SqliteStore(tmp_path / "registry.db", timeout_s=5.0, poll_interval_s=0.05)
    try:
        yield store
    finally:
        await store.close()


BACKENDS: dict[str, StoreFactory] = {"sqlite": sqlite_store}


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    return BACKENDS[request.param]
