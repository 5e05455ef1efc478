"""Fixtures of the service's tests (``tests/app``): real certificates made at test time
(trustme) and registry processes serving HTTPS and mutual TLS, real etcd members under
replicas. The fault tests' recovery-time summary: tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.pki import Pki
from harness.server import RegistryProcess
from tests.support.chromium import CHROMIUM, Chromium, chromium
from tests.support.chromium import SKIP_REASON as NO_CHROMIUM

ADMIN = "admin-token-5d2c0f7e8a61"
WORKER = "worker-token-b81e44a0c9"
READER = "reader-token-7f3a9c1d2e"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """A real headless Chromium, one per module that drives the status page."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    with chromium(tmp_path_factory.mktemp("chromium")) as b:
        yield b


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.make(tmp_path_factory.mktemp("pki"))


def tokens_file(directory: Path, *lines: str) -> Path:
    path = directory / "tokens"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def mutual_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """A registry that requires client certificates signed by ``pki.ca``, with tokens."""
    d = tmp_path_factory.mktemp("mtls")
    tokens = tokens_file(d, f"worker:{WORKER}", f"admin:{ADMIN}")
    with RegistryProcess(
        f"sqlite:///{d / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        tls=pki.mutual(),
        log_path=d / "registry.log",
    ) as proc:
        yield proc


@pytest.fixture
def etcd_single(tmp_path: Path) -> Iterator[EtcdCluster]:
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    with EtcdCluster(tmp_path / "etcd", size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd_trio(tmp_path: Path) -> Iterator[EtcdCluster]:
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    with EtcdCluster(tmp_path / "etcd", size=3) as cluster:
        yield cluster
