"""A real registry process on loopback, for tests: ``python -m app serve`` in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    ) -> None:
        """``prefix``: a command that runs the server (``prlimit --nofile=1024:1024``, say)."""
        self.store = store
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args)
        self.env = dict(env or {})
        self.log_path = log_path
        self.prefix = list(prefix)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> RegistryProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [
            *self.prefix, sys.executable, "-m", "app", "serve",
            "--host", self.host, "--port", str(self.port), "--store", self.store, *self.args,
        ]  # fmt: skip
        self._close_log()
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        log = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"registry exited with {self.proc.returncode}: {cmd}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
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
