"""The store under test. Every contract test runs once per backend listed in ``BACKENDS``;
a backend's factory yields a fresh, empty store (a real file, a real server).

The etcd backend shares one real etcd server per test session (started on first use) and
gives each test its own key prefix, so tests stay isolated without paying for a server each.
The ``etcds`` backend does the same on an etcd that serves TLS only, requires client
certificates and has authentication on (a user whose role covers ``/tls-*``), with auth tokens
that expire after 1 s unused, so the contract also runs across token renewals.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from app.store import EtcdAccess, Store
from app.store.sqlite.store import SqliteStore
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.pki import Pki

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
        if _etcd_dir is None:
            _etcd_dir = tempfile.TemporaryDirectory(prefix="store-etcd-")
        _etcd = EtcdCluster(Path(_etcd_dir.name) / "plain", size=1).start()
    return _etcd


class SecureEtcd:
    """One etcd with TLS, client certificates and auth, for the whole session."""

    def __init__(self, root: Path) -> None:
        self.tls = Pki.make(root / "certs")
        self.cluster = EtcdCluster(root / "etcd", size=1, tls=self.tls, auth_token_ttl_s=1)
        self.cluster.start()
        try:
            self.user = self.cluster.enable_auth("registry", f"pw-{uuid.uuid4().hex}", "/tls-")
        except BaseException:
            self.cluster.stop()
            raise
        self.password_file = root / "etcd-password"
        self.password_file.write_text(self.user.password + "\n")

    def access(self, **changes: object) -> EtcdAccess:
        """The settings a registry needs to reach it; ``changes`` override some."""
        fields: dict[str, object] = {
            "ca": self.tls.ca,
            "cert": self.tls.client_cert,
            "key": self.tls.client_key,
            "user": self.user.name,
            "password_file": self.password_file,
        }
        return EtcdAccess(**(fields | changes))  # type: ignore[arg-type]

    def env(self) -> dict[str, str]:
        """The same settings as a registry process's environment."""
        access = self.access()
        return {
            "REGISTRY_ETCD_CA": str(access.ca),
            "REGISTRY_ETCD_CERT": str(access.cert),
            "REGISTRY_ETCD_KEY": str(access.key),
            "REGISTRY_ETCD_USER": str(access.user),
            "REGISTRY_ETCD_PASSWORD_FILE": str(access.password_file),
        }


_secure: SecureEtcd | None = None


def shared_secure_etcd() -> SecureEtcd:
    global _secure, _etcd_dir
    if _secure is None:
        if _etcd_dir is None:
            _etcd_dir = tempfile.TemporaryDirectory(prefix="store-etcd-")
        _secure = SecureEtcd(Path(_etcd_dir.name) / "secure")
    return _secure


@asynccontextmanager
async def secure_etcd_store(tmp_path: Path) -> AsyncIterator[Store]:
    from app.store.etcd.store import EtcdStore

    secure = shared_secure_etcd()
    url = secure.cluster.url(f"tls-{uuid.uuid4().hex}")
    store = EtcdStore.from_url(url, timeout_s=5.0, access=secure.access())
    try:
        await store.start()
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def etcd_store(tmp_path: Path) -> AsyncIterator[Store]:
    from app.store.etcd.store import EtcdStore

    cluster = shared_etcd()
    store = EtcdStore.from_url(cluster.url(f"test-{uuid.uuid4().hex}"), timeout_s=5.0)
    try:
        yield store
    finally:
        await store.close()


BACKENDS: dict[str, StoreFactory] = {
    "sqlite": sqlite_store,
    "etcd": etcd_store,
    "etcds": secure_etcd_store,
}


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_etcd() -> Iterator[None]:
    global _etcd, _etcd_dir, _secure
    yield
    if _etcd is not None:
        _etcd.stop()
        _etcd = None
    if _secure is not None:
        _secure.cluster.stop()
        _secure = None
    if _etcd_dir is not None:
        _etcd_dir.cleanup()
        _etcd_dir = None


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    if request.param.startswith("etcd") and not etcd_available():
        pytest.skip(SKIP_REASON)
    return BACKENDS[request.param]
