"""Fixtures shared by every tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import RegistryProcess


@pytest.fixture
def registry_server(tmp_path: Path) -> Iterator[RegistryProcess]:
    """A real registry process on loopback over a fresh SQLite file, no tokens."""
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}", log_path=tmp_path / "registry.log"
    ) as server:
        yield server


@pytest.fixture
def client(registry_server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=registry_server.url, timeout=30.0) as c:
        yield c
