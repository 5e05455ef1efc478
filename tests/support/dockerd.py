"""A real Docker engine for the tests: the one already running, or one started and undone.

`DockerEngine()` uses a daemon that answers `docker info`. If none does, it starts Debian's
`dockerd` (docker.io) by hand (no systemd), and `close()` stops it and undoes what it did to
the host's network: Docker sets the iptables `FORWARD` policy to `DROP`, adds its chains and
NAT rules (nftables tables `ip filter` and `ip nat` under iptables-nft), turns on
`net.ipv4.ip_forward` and leaves its `docker0` bridge. Those break other network tests on the
machine, so a daemon the tests started is never left running: the tables it made are deleted,
the ones that were there already lose Docker's chains and get their policy back, and the
sysctls and links are as they were.

Images and the build cache live in the daemon's data root (/var/lib/docker) and persist from
one run to the next: a warm run rebuilds nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
# Debian's client, which matches Debian's daemon; any other `docker` on PATH as a fallback.
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
NFT = shutil.which("nft") or "/usr/sbin/nft"
IPTABLES = shutil.which("iptables") or "/usr/sbin/iptables"
SYSCTLS = (
    Path("/proc/sys/net/ipv4/ip_forward"),
    Path("/proc/sys/net/bridge/bridge-nf-call-iptables"),
    Path("/proc/sys/net/bridge/bridge-nf-call-ip6tables"),
)


def unavailable_reason() -> str | None:
    """Why no Docker engine can be had here, or None when one can."""
    if DOCKER is None:
        return "needs a Docker client (docker.io: make system-deps)"
    if _daemon_answers():
        return None
    if os.geteuid() != 0:
        return "no Docker daemon runs, and starting one needs root"
    missing = [p for p in (DOCKERD, NFT, IPTABLES) if not Path(p).exists()]
    if missing:
        return f"no Docker daemon runs and {', '.join(missing)} is missing (make system-deps)"
    return None


def _daemon_answers() -> bool:
    if DOCKER is None:
        return False
    run = subprocess.run(
        [DOCKER, "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return run.returncode == 0


def _run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def nft_tables() -> set[str]:
    """The nftables tables as `family name`, e.g. `ip filter`."""
    listed = _run(NFT, "list", "tables").stdout
    return {line.removeprefix("table ").strip() for line in listed.splitlines() if line.strip()}


def forward_policy() -> str:
    """The iptables FORWARD chain's policy (ACCEPT when the table does not exist)."""
    match = re.search(r"^-P FORWARD (\w+)", _run(IPTABLES, "-S", "FORWARD").stdout, re.M)
    return match[1] if match else "ACCEPT"


def _links() -> set[str]:
    out = _run("ip", "-o", "link", "show").stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


@dataclass
class HostNetwork:
    """What Docker changes on the host's network, as it was before."""

    tables: set[str]
    policy: str
    sysctls: dict[Path, str]
    links: set[str]

    @classmethod
    def snapshot(cls) -> HostNetwork:
        values = {p: p.read_text().strip() for p in SYSCTLS if p.exists()}
        return cls(nft_tables(), forward_policy(), values, _links())

    def restore(self) -> list[str]:
        """Undo Docker's changes; what could not be undone (empty when all was)."""
        problems: list[str] = []
        for table in sorted(nft_tables() - self.tables):
            family, name = table.split(" ", 1)
            run = _run(NFT, "delete", "table", family, name)
            if run.returncode != 0:
                problems.append(f"nft delete table {table}: {run.stderr.strip()}")
        for table in ("filter", "nat"):  # tables there before Docker: only Docker's part out
            if f"ip {table}" in self.tables:
                problems += _remove_docker_chains(table)
        if forward_policy() != self.policy:
            _run(IPTABLES, "-P", "FORWARD", self.policy)
        for path, value in self.sysctls.items():
            if path.exists() and path.read_text().strip() != value:
                path.write_text(value)
        for link in sorted(_links() - self.links):
            if link == "docker0" or link.startswith(("br-", "veth")):
                _run("ip", "link", "delete", link)
        return problems


def _remove_docker_chains(table: str) -> list[str]:
    rules = _run(IPTABLES, "-t", table, "-S").stdout.splitlines()
    for rule in rules:
        if rule.startswith("-A ") and "DOCKER" in rule:
            _run(IPTABLES, "-t", table, *rule.replace("-A ", "-D ", 1).split())
    chains = [r.split()[1] for r in rules if r.startswith("-N ") and "DOCKER" in r]
    for chain in chains:
        _run(IPTABLES, "-t", table, "-F", chain)
    problems = []
    for chain in chains:
        run = _run(IPTABLES, "-t", table, "-X", chain)
        if run.returncode != 0:
            problems.append(f"iptables -t {table} -X {chain}: {run.stderr.strip()}")
    return problems


@dataclass
class DockerEngine:
    """The daemon the tests use; `started` when this object started it (and will stop it)."""

    log_path: Path
    started: bool = False
    before: HostNetwork | None = None
    popen: subprocess.Popen[bytes] | None = None
    start_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def docker(self) -> str:
        assert DOCKER is not None
        return DOCKER

    def __enter__(self) -> DockerEngine:
        if _daemon_answers():
            return self
        self.before = HostNetwork.snapshot()
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [DOCKERD, "--pidfile", "/run/docker-tests.pid"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started = True
        try:
            deadline = time.monotonic() + 90
            while not _daemon_answers():
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"dockerd did not come up: {self.log_path.read_text()[-3000:]}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the daemon this object started, and undo its network changes."""
        if not self.started or self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        if self.before is not None:
            self.problems = self.before.restore()
        self.started = False
