"""A real registry process on loopback, for tests: ``python -m app serve`` in a subprocess,
over plain HTTP or, given :class:`TlsFiles`, HTTPS (and mutual TLS).

The launcher is the project's one (`workers.tools.procs`), shared with the benchmarks, the
demo and the vLLM launcher; this module keeps the tests' names for it (``RegistryProcess``:
``store``, ``host``, ``port``, ``args``, ``env``, ``log_path``, ``prefix``, ``tls``, ...).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.tools.procs import ROOT, free_port
from workers.tools.procs import RegistryProcess as _Launcher

__all__ = ["ROOT", "RegistryProcess", "TlsFiles", "free_port"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for an HTTPS registry: its certificate and key, the CA that signed them (for
    clients), and for mutual TLS the clients' CA plus one client's certificate and key."""

    cert: Path
    key: Path
    ca: Path
    client_ca: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    def server_args(self) -> list[str]:
        args = ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        return args + (["--tls-client-ca", str(self.client_ca)] if self.client_ca else [])

    def client_context(self, *, with_cert: bool = True) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        if with_cert and self.client_cert is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


class RegistryProcess(_Launcher):
    """The shared launcher; ``tls``: serve HTTPS with these files (``url`` is ``https://``)."""

    def __init__(self, store: str, *, tls: TlsFiles | None = None, **kwargs: Any) -> None:
        if tls is not None:
            kwargs["args"] = [*kwargs.get("args", ()), *tls.server_args()]
            kwargs["scheme"] = "https"
            kwargs["verify"] = tls.client_context()
        super().__init__(store, **kwargs)
        self.tls = tls
