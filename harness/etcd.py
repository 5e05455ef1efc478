"""Real etcd for tests: Debian's ``etcd`` binary on loopback, one member or a cluster.

Each member has its own free ports and data directory (laid out again when another process
took a port first: a member is healthy only once it holds its client port itself, not on
another cluster's answer there), and can be killed (SIGKILL) and restarted on the same data,
so tests can take a cluster below quorum and back. Given a
:class:`~harness.pki.Pki` (certificates made at test time) the members serve TLS to
clients only (``--client-cert-auth``); :meth:`EtcdCluster.enable_auth` turns on etcd's
authentication with a user whose role covers one key prefix (``etcdctl``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from harness.pki import Pki
from harness.server import free_port
from workers.tools.procs import listens_on

ETCD_BIN = os.environ.get("ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL_BIN = shutil.which("etcdctl") or "/usr/bin/etcdctl"
SKIP_REASON = (
    "the etcd binary is not installed (apt-get install etcd-server, or set ETCD_BIN): "
    "the etcd store and its fault tests need a real etcd"
)


def etcd_available() -> bool:
    return Path(ETCD_BIN).is_file() and os.access(ETCD_BIN, os.X_OK)


@dataclass(frozen=True)
class EtcdUser:
    """A user :meth:`EtcdCluster.enable_auth` made, with readwrite on keys under ``prefix``."""

    name: str
    password: str
    prefix: str


class EtcdMember:
    def __init__(
        self,
        name: str,
        root: Path,
        cluster_token: str,
        tls: Pki | None = None,
        auth_token_ttl_s: int | None = None,
        max_request_bytes: int | None = 8 * 1024 * 1024,
    ) -> None:
        self.name = name
        self.tls = tls
        self.auth_token_ttl_s = auth_token_ttl_s
        self.max_request_bytes = max_request_bytes
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        self.cluster_token = cluster_token
        self.initial_cluster = ""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        # Short raft timings: loopback is fast, and elections bound the recovery we measure.
        cmd = [
            ETCD_BIN,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            self.cluster_token,
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
            "--logger",
            "zap",
            "--log-level",
            "warn",
            "--enable-pprof=false",
        ]
        if self.max_request_bytes is not None:  # None: etcd's own default, 1.5 MiB
            cmd += ["--max-request-bytes", str(self.max_request_bytes)]
        if self.tls is not None:
            cmd += [
                "--cert-file",
                str(self.tls.server_cert),
                "--key-file",
                str(self.tls.server_key),
                "--trusted-ca-file",
                str(self.tls.ca),
                "--client-cert-auth",
            ]
        if self.auth_token_ttl_s is not None:  # simple tokens unused this long expire
            cmd += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        verify: ssl.SSLContext | bool = self.tls.ssl_context() if self.tls else True
        try:
            answer = httpx.get(f"{self.client_url}/health", timeout=1.0, verify=verify)
        except httpx.HTTPError:
            return False
        if answer.status_code != 200 or answer.json().get("health") != "true":
            return False
        # Another member on this port (it bound the port first): not ours, whatever it says.
        return self.proc is not None and listens_on(self.proc.pid, self.client_port) is not False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


class EtcdCluster:
    """``size`` members on loopback under ``root``; use as a context manager. ``tls``: serve
    clients TLS only, with client certificates required; ``auth_token_ttl_s``: etcd's
    ``--auth-token-ttl`` (how long an unused auth token lives); ``max_request_bytes``:
    etcd's ``--max-request-bytes`` (8 MiB here unless given; None: etcd's default)."""

    def __init__(
        self,
        root: Path,
        size: int = 1,
        *,
        tls: Pki | None = None,
        auth_token_ttl_s: int | None = None,
        max_request_bytes: int | None = 8 * 1024 * 1024,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.size = size
        self.tls = tls
        self.auth_token_ttl_s = auth_token_ttl_s
        self.max_request_bytes = max_request_bytes
        self.members: list[EtcdMember] = []
        self._layout()

    def _layout(self) -> None:
        """Fresh ports, names and data dirs for a new cluster."""
        token = f"test-{os.getpid()}-{time.monotonic_ns()}"
        attempt = time.monotonic_ns() % 1_000_000
        self.members = [
            EtcdMember(
                f"m{i}-{attempt}",
                self.root,
                token,
                self.tls,
                self.auth_token_ttl_s,
                self.max_request_bytes,
            )
            for i in range(self.size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, prefix: str = "registry", scheme: str | None = None) -> str:
        scheme = scheme or ("etcds" if self.tls else "etcd")
        return f"{scheme}://{','.join(self.endpoints)}/{prefix}"

    def metric(self, name: str, method: str | None = None) -> float:
        """The sum of one of etcd's own metrics on the first member (of one gRPC method's
        series, if given)."""
        text = httpx.get(f"{self.members[0].client_url}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and (method is None or f'grpc_method="{method}"' in line)
        )

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run ``etcdctl`` against the live members (with the test certificates under TLS,
        as ``user`` ("name:password") once auth is on); returns its output."""
        live = [m.endpoint for m in self.members if m.alive()]
        cmd = [ETCDCTL_BIN, "--endpoints", ",".join(live), "--command-timeout=5s"]
        cmd += self.tls.etcdctl_flags() if self.tls else []
        cmd += ["--user", user] if user else []
        done = subprocess.run(
            [*cmd, *args],
            capture_output=True,
            text=True,
            timeout=15,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def enable_auth(self, user: str, password: str, prefix: str) -> EtcdUser:
        """etcd's authentication on: ``root`` (password ``password``, for the tests' own
        admin calls) and ``user`` whose role reads and writes keys starting with ``prefix``
        (the docs' recipe, docs/deployment.md)."""
        self.etcdctl("user", "add", f"root:{password}")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("role", "add", user)
        self.etcdctl("role", "grant-permission", user, "--prefix=true", "readwrite", prefix)
        self.etcdctl("user", "add", f"{user}:{password}")
        self.etcdctl("user", "grant-role", user, user)
        self.etcdctl("auth", "enable")
        return EtcdUser(user, password, prefix)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        # A free port can be taken by someone else between our probe and etcd's bind: then
        # a member exits at once, and a fresh layout (new ports, new data) is tried.
        for attempt in range(3):
            for m in self.members:
                m.start()
            try:
                self.wait_healthy(timeout_s)
                return self
            except RuntimeError:
                self.stop()
                if attempt == 2:
                    raise
                self._layout()
        return self

    def wait_healthy(self, timeout_s: float = 30.0, members: list[int] | None = None) -> float:
        """Wait until the chosen members (all by default) answer /health; returns seconds."""
        chosen = [self.members[i] for i in members] if members else self.members
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            for m in chosen:
                if not m.alive():
                    tail = m.log_path.read_text(errors="replace")[-800:]
                    raise RuntimeError(f"etcd member {m.name} exited ({m.log_path}): {tail}")
            if all(m.healthy() for m in chosen):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"etcd members not healthy within {timeout_s} s")

    def leader_index(self) -> int:
        """The index of the member that leads now (asks the live members with etcdctl;
        without etcdctl, the first live member stands in)."""
        live = [m for m in self.members if m.alive()]
        if not Path(ETCDCTL_BIN).is_file():
            return self.members.index(live[0])
        out = self.etcdctl("endpoint", "status", "-w", "json")
        statuses = json.loads(out)
        leader = statuses[0]["Status"]["leader"]
        for status in statuses:
            if status["Status"]["header"]["member_id"] == leader:
                return self.endpoints.index(status["Endpoint"])
        raise RuntimeError(f"no live member leads: {statuses}")

    def kill(self, index: int) -> None:
        self.members[index].kill()

    def restart(self, index: int) -> None:
        if not self.members[index].alive():
            self.members[index].start()

    def stop(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.kill()

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
