"""The store under test. Every contract test runs once per backend listed in ``BACKENDS``;
a backend's factory yields a fresh, empty store (a real file, a real server).

The etcd backend shares one real etcd server per test session (started on first use) and
gives each test its own key prefix, so tests stay isolated without paying for a server each.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from app.store import Store
from app.store.sqlite import SqliteStore
from tests.support.etcd import SKIP_REASON, EtcdCluster, etcd_available

StoreFactory = Callable[[Path], AbstractAsyncContextManager[Store]]


@asynccontextmanager
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Store]:
    store = SqliteStore(tmp_path / "registry.db", timeout_s=5.0)
    try:
        yield store
    finally:
        await store.close()


_etcd: EtcdCluster | None = None
_etcd_dir: tempfile.TemporaryDirectory[str] | None = None


def shared_etcd() -> EtcdCluster:
    """One single-member etcd for the whole session."""
    global _etcd, _etcd_dir
    if _etcd is None:
        _etcd_dir = tempfile.TemporaryDirectory(prefix="store-etcd-")
        _etcd = EtcdCluster(Path(_etcd_dir.name), size=1).start()
    return _etcd


@asynccontextmanager
async def etcd_store(tmp_path: Path) -> AsyncIterator[Store]:
    from app.store.etcd import EtcdStore

    cluster = shared_etcd()
    store = EtcdStore.from_url(cluster.url(f"test-{uuid.uuid4().hex}"), timeout_s=5.0)
    try:
        yield store
    finally:
        await store.close()


BACKENDS: dict[str, StoreFactory] = {"sqlite": sqlite_store, "etcd": etcd_store}


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_etcd() -> Iterator[None]:
    global _etcd, _etcd_dir
    yield
    if _etcd is not None:
        _etcd.stop()
        _etcd = None
    if _etcd_dir is not None:
        _etcd_dir.cleanup()
        _etcd_dir = None


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    if request.param == "etcd" and not etcd_available():
        pytest.skip(SKIP_REASON)
    return BACKENDS[request.param]
