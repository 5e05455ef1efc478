"""Shared plumbing: machine description, percentiles, progress, result files, processes."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from workers.tools.procs import RegistryProcess
from workers.tools.procs import free_port as free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
HOST = "127.0.0.1"

_T0 = time.monotonic()


def say(msg: str) -> None:
    """Progress on stderr, stamped with seconds since the run began."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    return {
        "n": len(seconds),
        "p50_ms": round(pct(seconds, 50) * 1000, 3),
        "p99_ms": round(pct(seconds, 99) * 1000, 3),
        "max_ms": round(max(seconds) * 1000, 3) if seconds else float("nan"),
    }


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return float("nan")


def _tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "-"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "-"


def machine() -> dict[str, Any]:
    git = _tool_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "git": git,
        "versions": {
            d: _version(d)
            for d in (
                "fastapi",
                "starlette",
                "uvicorn",
                "uvloop",
                "httptools",
                "pydantic",
                "aiohttp",
                "aetcd",
                "grpcio",
                "torch",
                "numpy",
                "nixl",
            )
        }
        | {
            "sqlite": __import__("sqlite3").sqlite_version,
            "etcd": _tool_version(["etcd", "--version"]).removeprefix("etcd Version: "),
            "wrk": _tool_version(["wrk", "--version"]).split(" [")[0],
        },
    }


def write_result(name: str, data: dict[str, Any], where: Path = RESULTS) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200, the process dies, or ``timeout_s`` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=1.0) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


@contextlib.contextmanager
def process(
    cmd: list[str], *, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` for the block's duration; terminate it (then kill) on the way out."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=out
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if log:
            out.close()  # type: ignore[union-attr]


def _stat_split(stat: Path) -> tuple[float, float]:
    """User and system CPU seconds in a ``/proc`` ``stat`` file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds a process (all its threads) has used so far."""
    return _stat_split(Path(f"/proc/{pid}/stat"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used so far."""
    return sum(cpu_split(pid))


def loop_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process's main thread (the registry's event loop)."""
    return sum(_stat_split(Path(f"/proc/{pid}/task/{pid}/stat")))


def etcd_cpu_s(cluster: Any) -> float:
    """User + system CPU seconds every member of an etcd cluster (``harness.etcd``) has used."""
    return sum(cpu_seconds(member.proc.pid) for member in cluster.members)


class Server(str):
    """A server's base URL that also carries its process id (for CPU accounting)."""

    pid: int


@contextlib.contextmanager
def registry_server(
    store: str, *, log: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """``python -m app serve`` on a free loopback port with its default settings, save
    ``env``'s ``REGISTRY_*`` variables."""
    registry = RegistryProcess(store, host=HOST, log_path=log, env=env).start(timeout_s=30.0)
    try:
        url = Server(registry.url)
        url.pid = registry.pid
        yield url
    finally:
        registry.stop()


def etcd_store_available() -> tuple[bool, str]:
    """The etcd rows run when the etcd backend imports and the etcd binary exists."""
    try:
        import app.store.etcd.store  # noqa: F401
    except ImportError as exc:
        return False, f"app.store.etcd.store does not import ({exc})"
    from harness.etcd import SKIP_REASON, etcd_available

    if not etcd_available():
        return False, SKIP_REASON
    return True, ""


@contextlib.contextmanager
def peer(args: list[str], timeout_s: float = 120.0) -> Iterator[dict[str, Any]]:
    """Start ``bench.nixl_peer`` with ``args``; yield its ready line; close its stdin to end."""
    import select

    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.nixl_peer", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    try:
        info: dict[str, Any] | None = None
        while info is None and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            line = proc.stdout.readline() if ready else b""
            if not line:
                break
            if line.startswith(b"BENCH-READY "):
                info = json.loads(line.removeprefix(b"BENCH-READY "))
        if info is None:
            raise RuntimeError(f"NIXL peer {args} gave no ready line (exit {proc.poll()})")
        yield info
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def cpu_times() -> tuple[int, int]:
    """The machine's CPU ticks so far, every core: all of them, and the idle ones (iowait
    too), from ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields), idle


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of all cores busy between two ``cpu_times()`` (other tenants included)."""
    return 1.0 - (after[1] - before[1]) / max(1, after[0] - before[0])


def busy_fraction(interval_s: float = 1.0) -> float:
    """Share of all cores busy over ``interval_s`` (other tenants included)."""
    before = cpu_times()
    time.sleep(interval_s)
    return busy_share(before, cpu_times())


def wait_quiet(max_s: float, threshold: float = 0.15) -> float:
    """Wait (at most ``max_s``) for the machine to be idle; return the last busy fraction."""
    deadline = time.monotonic() + max_s
    busy = busy_fraction(0.5)
    while busy > threshold and time.monotonic() < deadline:
        say(f"  machine {busy:.0%} busy (other processes); waiting for it to quiet down")
        busy = busy_fraction(2.0)
    return round(busy, 3)
