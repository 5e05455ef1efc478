"""The TLS tier: real certificates made at test time (trustme), real registry processes
serving HTTPS and mutual TLS on loopback, the real clients (worker library, vLLM plugin
settings and lease, CLI) talking to them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.server import RegistryProcess, TlsFiles

ADMIN = "admin-token-5d2c0f7e8a61"
WORKER = "worker-token-b81e44a0c9"
READER = "reader-token-7f3a9c1d2e"


@dataclass(frozen=True)
class Pki:
    """A CA with a server certificate (127.0.0.1, localhost) and a client certificate, and
    another CA (with its own client certificate) that signed nothing the registry trusts."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path

    def https(self) -> TlsFiles:
        return TlsFiles(self.server_cert, self.server_key, self.ca)

    def mutual(self) -> TlsFiles:
        return TlsFiles(
            self.server_cert, self.server_key, self.ca, self.ca, self.client_cert, self.client_key
        )


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("rank-0.prefill-0.example")
    stranger = other.issue_cert("rank-0.prefill-0.example")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    for name, issued in (("server", server), ("client", client), ("other-client", stranger)):
        issued.cert_chain_pems[0].write_to_path(str(d / f"{name}.crt"))
        for extra in issued.cert_chain_pems[1:]:
            extra.write_to_path(str(d / f"{name}.crt"), append=True)
        issued.private_key_pem.write_to_path(str(d / f"{name}.key"))
    return Pki(
        d / "ca.pem",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "other-ca.pem",
        d / "other-client.crt",
        d / "other-client.key",
    )


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
