"""Fixtures of the workers' tests: real registry processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.server import RegistryProcess


def _serve(tmp_path: Path, name: str) -> Iterator[str]:
    store = f"sqlite:///{tmp_path / f'{name}.db'}"
    with RegistryProcess(store, log_path=tmp_path / f"{name}.log") as server:
        yield server.url


@pytest.fixture
def registry_url(tmp_path: Path) -> Iterator[str]:
    """URL of a real registry process on loopback (fresh SQLite file, no tokens)."""
    yield from _serve(tmp_path, "registry")


@pytest.fixture
def other_registry_url(tmp_path: Path) -> Iterator[str]:
    """A second, unrelated registry: it never issued the first one's engine ids."""
    yield from _serve(tmp_path, "other-registry")
