"""A real registry process on loopback, for tests: ``python -m app serve`` in a subprocess,
over plain HTTP or, given :class:`TlsFiles`, HTTPS (and mutual TLS)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


class RegistryProcess:
    """Starts, stops, kills and restarts one ``engine-registry serve`` on a fixed port."""

    def __init__(
        self,
        store: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        prefix: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        """``prefix``: a command that runs the server (``prlimit --nofile=1024:1024``, say);
        ``tls``: serve HTTPS with these files (``url`` is then ``https://``)."""
        self.store = store
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args)
        self.env = dict(env or {})
        self.log_path = log_path
        self.prefix = list(prefix)
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> RegistryProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [
            *self.prefix, sys.executable, "-m", "app", "serve",
            "--host", self.host, "--port", str(self.port), "--store", self.store, *self.args,
            *(self.tls.server_args() if self.tls else []),
        ]  # fmt: skip
        self._close_log()
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        log = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        verify: ssl.SSLContext | bool = self.tls.client_context() if self.tls else True
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"registry exited with {self.proc.returncode}: {cmd}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0, verify=verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"registry did not serve /healthz within {timeout_s} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def __enter__(self) -> RegistryProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
