"""Fixtures of the registry's tests on etcd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.etcd import EtcdCluster


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A one-member etcd of the test module's own: etcd's metrics count that module's calls
    only (the modules that use it skip when etcd is not installed)."""
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd")), size=1) as cluster:
        yield cluster
