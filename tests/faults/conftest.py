"""Fixtures of the fault tier: real etcd members and registry replicas on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.helpers import RECOVERY, write_recovery
from tests.support.etcd import SKIP_REASON, EtcdCluster, etcd_available

needs_etcd = pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = write_recovery()
    if path is None:
        return
    terminalreporter.section("fault recovery times (seconds)")
    for name, facts in sorted(RECOVERY.items()):
        terminalreporter.write_line(f"{name}: {facts}")
    terminalreporter.write_line(f"written to {path}")
