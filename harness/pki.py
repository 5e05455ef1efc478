"""Certificates made at test time (``trustme``), as PEM files: one maker for the registry's
HTTPS and mutual-TLS tests and for etcd served over TLS."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from harness.server import TlsFiles


@dataclass(frozen=True)
class Pki:
    """A CA with a server certificate (127.0.0.1, localhost) and a client certificate, and
    another CA (with its own client certificate) that signed nothing the first one trusts."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path

    @classmethod
    def make(cls, root: Path, client_cn: str = "engine-registry") -> Pki:
        """Make the CAs and certificates now, as files under ``root``."""
        import trustme

        root.mkdir(parents=True, exist_ok=True)
        ca, other = trustme.CA(organization_name="test CA"), trustme.CA()
        pki = cls(
            root / "ca.pem",
            root / "server.pem",
            root / "server.key",
            root / "client.pem",
            root / "client.key",
            root / "other-ca.pem",
            root / "other-client.pem",
            root / "other-client.key",
        )
        ca.cert_pem.write_to_path(str(pki.ca))
        other.cert_pem.write_to_path(str(pki.other_ca))
        client_name = f"{client_cn}.client.test"
        for issued, cert, key in (
            (ca.issue_cert("127.0.0.1", "localhost"), pki.server_cert, pki.server_key),
            (ca.issue_cert(client_name, common_name=client_cn), pki.client_cert, pki.client_key),
            (other.issue_cert(client_name, common_name=client_cn), *pki.other_client),
        ):
            issued.cert_chain_pems[0].write_to_path(str(cert))
            for extra in issued.cert_chain_pems[1:]:
                extra.write_to_path(str(cert), append=True)
            issued.private_key_pem.write_to_path(str(key))
        return pki

    @property
    def other_client(self) -> tuple[Path, Path]:
        return self.other_client_cert, self.other_client_key

    def https(self) -> TlsFiles:
        """The registry serving HTTPS with these files."""
        return TlsFiles(self.server_cert, self.server_key, self.ca)

    def mutual(self) -> TlsFiles:
        """The registry requiring client certificates signed by ``ca``."""
        return TlsFiles(
            self.server_cert, self.server_key, self.ca, self.ca, self.client_cert, self.client_key
        )

    def etcdctl_flags(self) -> list[str]:
        cert, key = str(self.client_cert), str(self.client_key)
        return ["--cacert", str(self.ca), "--cert", cert, "--key", key]

    def ssl_context(self) -> ssl.SSLContext:
        """A client context trusting ``ca`` and presenting the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context
