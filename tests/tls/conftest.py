"""The TLS tier: real certificates made at test time (trustme), real registry processes
serving HTTPS and mutual TLS on loopback, the real clients (worker library, vLLM plugin
settings and lease, CLI) talking to them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pki import Pki
from tests.support.server import RegistryProcess

ADMIN = "admin-token-5d2c0f7e8a61"
WORKER = "worker-token-b81e44a0c9"
READER = "reader-token-7f3a9c1d2e"


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
