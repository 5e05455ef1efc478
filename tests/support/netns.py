"""Hosts made of Linux namespaces, for tests that need several machines on one.

A `Network` is a bridge the test makes and, per host, a network namespace joined to it by a
veth pair whose inside end is `eth0` with its own address, and an /etc/hosts of its own
(`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts), as Docker gives a container.
The bridge and the veths' outer ends live in a namespace of their own (`er-TAG-switch`), not
in the host's: bridged frames pass the netfilter of the bridge's namespace
(`bridge-nf-call-iptables`), and on the host a running Docker daemon sets the `FORWARD`
policy to `DROP`. The switch namespace has no rules, so the hosts reach each other whatever
the machine's firewall says, and nothing of the host's firewall is touched.
`Host.spawn` runs a command there the way a container runs: in new PID, UTS (its own hostname)
and IPC namespaces, the command as PID 1 that gets the stop signal; when the `unshare` above
it dies, the kernel kills everything inside.

Everything the network makes carries its tag, the test process's pid (interfaces `erTAGbr`,
`erTAGvN` in the switch namespace, namespaces `er-TAG-NAME`), and `close()` removes all of
it, killing whatever still runs in its namespaces (only those processes: they are this
test's). Spawned commands die
with the test process even when it is SIGKILLed; `sweep_stale()`, run by every new
`Network`, removes the namespaces and interfaces such a run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PREFIX = "er-"
IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NETNS_ETC = Path("/etc/netns")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces, veth pairs and a bridge"
    if not Path(IP).exists() or not Path(UNSHARE).exists():
        return "needs `ip` (iproute2) and `unshare` (util-linux)"
    probe = subprocess.run(
        [IP, "netns", "list"], capture_output=True, text=True, timeout=10, check=False
    )
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([IP, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    run = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in run.stdout.split()] if run.returncode == 0 else []


def _kill_namespace(ns: str, deadline_s: float = 10) -> None:
    """SIGKILL every process in `ns` (only this test's run there) and wait for them."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "delete", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def sweep_stale() -> None:
    """Remove namespaces and bridges of earlier runs whose process is gone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        tag = name[len(PREFIX) :].split("-")[0]
        if tag.isdigit() and not _pid_alive(int(tag)):
            _remove_namespace(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        ours = re.fullmatch(r"er(\d+)(?:br|v\d+)", name)  # a bridge or a veth of a run
        if ours and not _pid_alive(int(ours[1])):
            _ip("link", "delete", name, check=False)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (even by SIGKILL).

    `unshare --kill-child` then takes the whole PID namespace with it.
    """
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Proc:
    """A command running as PID 1 of its own namespaces inside a host."""

    name: str
    host: Host
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] | None = None

    def inner_pid(self) -> int | None:
        """PID (in this test's namespace) of the command under `unshare`: the one to signal."""
        children = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children")
        with contextlib.suppress(OSError, ValueError):
            pids = children.read_text().split()
            return int(pids[0]) if pids else None
        return None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Deliver `sig` to the command itself, as `docker stop` does to a container's PID 1."""
        pid = self.inner_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=max(0.1, timeout_s))
        finally:
            self.close_log()

    def kill(self) -> None:
        """SIGKILL `unshare`; the kernel then kills everything in the PID namespace."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        self.close_log()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 60) -> str:
        kept = [line for line in self.log().splitlines() if "NIXL INFO" not in line]
        return f"--- {self.name} (exit {self.poll()}) ---\n" + "\n".join(kept[-lines:])


@dataclass
class Host:
    network: Network
    name: str
    ns: str
    address: str
    hostname: str
    procs: list[Proc] = field(default_factory=list)

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command in this host's network namespace and wait for it."""
        return subprocess.run(
            [IP, "netns", "exec", self.ns, *argv],
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
    ) -> Proc:
        """Start `argv` like a container's command: own PID/UTS/IPC namespaces, hostname set."""
        wrapper = [
            IP,
            "netns",
            "exec",
            self.ns,
            UNSHARE,
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--uts",
            "--ipc",
            "/bin/sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *argv,
        ]
        log = open(log_path, "ab")  # noqa: SIM115 (closed by Proc)
        popen = subprocess.Popen(
            wrapper,
            env=dict(env),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        proc = Proc(name, self, popen, log_path, log)
        self.procs.append(proc)
        return proc


class Network:
    """A bridge and the namespaces on it, all removed by `close()` (also on failure)."""

    def __init__(self, subnet: str = "10.231.0", tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.subnet = subnet
        self.bridge = f"er{self.tag}br"
        if len(self.bridge) > 15:
            raise ValueError(f"tag {self.tag!r} makes interface names too long")
        self.switch = f"{PREFIX}{self.tag}-switch"  # the bridge's own namespace
        self.hosts: dict[str, Host] = {}
        self._next = 2
        self._made_switch = False

    def __enter__(self) -> Network:
        sweep_stale()
        try:
            _ip("netns", "add", self.switch)
            self._made_switch = True
            _ip("-n", self.switch, "link", "add", "name", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str, hostname: str | None = None) -> Host:
        """A namespace on the bridge with the next address of the subnet."""
        index = self._next
        self._next += 1
        ns = f"{PREFIX}{self.tag}-{name}"
        address = f"{self.subnet}.{index}"
        veth = f"er{self.tag}v{index}"
        host = Host(self, name, ns, address, hostname or name)
        self.hosts[name] = host
        _ip("netns", "add", ns)
        _ip(
            "-n",
            self.switch,
            "link",
            "add",
            veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        _ip("-n", self.switch, "link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return host

    def write_hosts(self, extra: Mapping[str, str] | None = None) -> None:
        """Give every namespace an /etc/hosts naming every host (and `extra` names)."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for host in self.hosts.values():
            names = sorted({host.name, host.hostname})
            lines.append(f"{host.address}\t{' '.join(names)}")
        for name, address in (extra or {}).items():
            lines.append(f"{address}\t{name}")
        text = "\n".join(lines) + "\n"
        for host in self.hosts.values():
            etc = NETNS_ETC / host.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(text)

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                proc.kill()
        for host in self.hosts.values():
            _remove_namespace(host.ns)
        if self._made_switch:  # the bridge and the veths go with it
            _remove_namespace(self.switch)
            self._made_switch = False
        self.hosts.clear()

    def leftovers(self) -> list[str]:
        """What of this network still exists (empty after `close()`)."""
        found = []
        listed = _ip("netns", "list", check=False).stdout
        found += [line.split(" ")[0] for line in listed.splitlines() if f"-{self.tag}-" in line]
        links = _ip("-o", "link", "show", check=False).stdout  # none in the host's namespace
        found += [
            line.split(":")[1].strip().split("@")[0]
            for line in links.splitlines()
            if f"er{self.tag}" in line
        ]
        found += [str(p) for p in NETNS_ETC.glob(f"{PREFIX}{self.tag}-*")]
        return found
