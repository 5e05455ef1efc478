"""Process helpers shared by the tests, the benchmarks, the demo and the vLLM launcher: one
`free_port`, one way to run a registry (`engine-registry serve`) as a process, and `Proc`, a
child in its own process group logging to a file (vLLM nodes, torchrun launches, the demo's
workers, whose lines it can also hand to a callback as they come).

`RegistryProcess` starts `python -m app serve` on a port (a free loopback one unless given),
waits for `/healthz` to answer 200 from the child itself (`listens_on`) within a deadline
(failing at once, with the log's tail, if the process exits first; a picked port someone else
took first is picked again), and stops it: SIGTERM, then SIGKILL after a grace period. It
can be killed with any signal and started again on the same port and store (a restart).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, for a child to bind later (``free_port_run``:
    below the kernel's ephemeral range)."""
    return free_port_run(1, host=host)


PORTS = (20000, 32000)  # below the kernel's ephemeral range (32768 and up on Linux)
SLICES = 4  # the range split between concurrent test processes: see port_slice
RECENT_S = 120.0  # a port handed out is not handed out again by this process for this long
_handed: dict[int, float] = {}


def port_slice(low: int = PORTS[0], high: int = PORTS[1]) -> tuple[int, int]:
    """This process's share of ``low``..``high``: ``make test`` runs two pytest-xdist workers
    and the deploy tier at once, each picking ports for its children; in disjoint slices
    (``PYTEST_XDIST_WORKER`` gw0 → 1, gw1 → 2, none → 0) no two of them can pick one port
    before either child binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (high - low) // SLICES
    first = low + (index % SLICES) * width
    return first, first + width


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports nothing listens on, below the kernel's
    ephemeral range, where outgoing connections take no port: a port picked in that range
    can become another connection's own before the child binds it (``Address already in
    use``). vLLM binds DP rank r's NIXL side channel at base + r. Picked in this process's
    slice (``port_slice``) and never one this process handed out in the last ``RECENT_S``
    (its child may not have bound it yet)."""
    low, high = port_slice()
    at = time.monotonic()
    for port, when in list(_handed.items()):
        if at - when > RECENT_S:
            _handed.pop(port, None)
    for _ in range(200):
        base = random.randrange(low, high - count)
        chosen = range(base, base + count)
        if any(port in _handed or port_taken(port, host) for port in chosen):
            continue
        _handed.update(dict.fromkeys(chosen, at))
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high} after 200 tries")


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` or one of its descendants holds the TCP socket listening on
    ``port`` (in ``pid``'s network namespace); None where ``/proc`` cannot tell.

    A port picked free can be bound by someone else before the child binds it: then the
    child exits, but until it does, a readiness probe on the port gets the other server's
    answer. Asking who holds the listener tells the two apart."""
    try:
        inodes = _listening_inodes(pid, port)
        holders = _descendants(pid)
        for holder in holders:
            fds = Path(f"/proc/{holder}/fd")
            with contextlib.suppress(OSError):
                for fd in fds.iterdir():
                    with contextlib.suppress(OSError):
                        link = os.readlink(fd)
                        if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                            return True
    except OSError:
        return None
    return False


def _listening_inodes(pid: int, port: int) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` in ``pid``'s network namespace."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(int(inode))
    return found


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from each process's parent in ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        here = todo.pop()
        out.append(here)
        todo.extend(children.get(here, []))
    return out


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something binds ``port`` on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path | None, chars: int = 2000) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return path.read_text(errors="replace")[-chars:]


class Proc:
    """One child in its own process group, logging to a file; stopped as a group.

    ``echo``: also hand each line of its output (stdout and stderr, without the newline) to
    this callback as it comes, from a thread of this process; the log file gets every line.

    The child leads a new process group (stopped as a group) in this process's session: a
    session of its own would be a scheduling autogroup of its own, and a busy vLLM decode's
    group starved a prefill's in another one (docs/vllm-plugin.md "Starved prefill")."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        *,
        cwd: Path = ROOT,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log
        self.pump: threading.Thread | None = None
        if echo is None:
            with open(log, "ab") as out:  # the child keeps its own descriptor
                self.popen = subprocess.Popen(
                    self.cmd,
                    cwd=cwd,
                    env=dict(env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    process_group=0,
                )
            return
        self.popen = subprocess.Popen(
            self.cmd,
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        self.pump = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self.pump.start()

    def _pump(self, echo: Callable[[str], None]) -> None:
        stream = self.popen.stdout
        assert stream is not None  # a PIPE when there is an echo
        with self.log_path.open("ab") as log, stream:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                echo(raw.decode(errors="replace").rstrip())

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (at most `timeout_s`) until the output of an exited child is all logged."""
        if self.pump is not None:
            self.pump.join(timeout=timeout_s)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None if it still runs after `timeout_s`."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole group (torchrun, vLLM: their children too)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = 10.0, reap_s: float = 30.0) -> None:
        """SIGTERM the group, SIGKILL after `grace_s`; children left behind go too. Then reap
        the child (at most `reap_s`: a killed vLLM process frees gigabytes first), so no
        `Popen` is collected while its process still runs."""
        if self.alive():
            self.signal(signal.SIGTERM)
            if self.wait(grace_s) is None:
                self.signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.wait(reap_s)
        self.drain()


class RegistryProcess:
    """One ``engine-registry serve`` (``python -m app serve``) process on a fixed port."""

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
        python: str | None = None,
        environ: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        new_session: bool = False,
        scheme: str = "http",
        verify: ssl.SSLContext | str | bool = True,
        poll_s: float = 0.05,
    ) -> None:
        """``args``: more ``serve`` flags. ``env``: variables over ``environ`` (default: this
        process's environment). ``prefix``: a command that runs the server (``prlimit
        --nofile=1024:1024``, say). ``python``: the interpreter (default: this one).
        ``new_session``: its own process group, stopped as a group. ``scheme``/``verify``:
        how ``/healthz`` is reached (``https`` and a CA file for a TLS registry)."""
        self.store = store
        self.host = host
        self.port = port or free_port(host)
        self.picked = port is None  # ours to change if someone else binds it first
        self.served = False  # answered /healthz once: a restart keeps its port
        self.args = list(args)
        self.env = dict(env or {})
        self.environ = dict(os.environ if environ is None else environ)
        self.log_path = log_path
        self.prefix = list(prefix)
        self.python = python or sys.executable
        self.cwd = cwd
        self.new_session = new_session
        self.scheme = scheme
        self.verify = verify
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the registry process is not running: call start() first")
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            *self.prefix,
            self.python,
            "-m",
            "app",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--store",
            self.store,
            *self.args,
        ]

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start it and wait until ``/healthz`` answers 200, at most ``timeout_s``.

        The answer counts only from the child itself (``listens_on``). A port this object
        picked that someone else took before the child bound it is picked again, at most
        twice, on the first start only (a restart keeps its port)."""
        deadline = time.monotonic() + timeout_s
        tries = 1
        while self._launch(deadline, timeout_s, retry=tries < 3):
            tries += 1
            self.port = free_port(self.host)
        self.served = True
        return self

    def _launch(self, deadline: float, timeout_s: float, retry: bool) -> bool:
        """One launch; True when it should be tried again on another port: the child exited,
        the port was picked here, it never served yet, and someone else holds the port."""
        env = {**self.environ, "PYTHONUNBUFFERED": "1", **self.env}
        cmd = self.command()
        self._close_log()
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        log = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.cwd,
            env=env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=self.new_session,
        )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self._close_log()
                if retry and not self.served and self.picked and port_taken(self.port, self.host):
                    return True
                raise RuntimeError(f"registry exited with {code}: {cmd}\n{log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"{self.url}/healthz", timeout=1.0, verify=self.verify)
                if answer.status_code == 200 and listens_on(self.proc.pid, self.port) is not False:
                    return False
            time.sleep(self.poll_s)
        self.kill()
        raise TimeoutError(
            f"registry did not serve /healthz within {timeout_s} s: {cmd}\n"
            f"{log_tail(self.log_path)}"
        )

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL, grace_s: float = 15.0) -> None:
        """Send ``sig``, wait up to ``grace_s`` for the exit, then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self, grace_s: float = 15.0) -> None:
        self.kill(signal.SIGTERM, grace_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
