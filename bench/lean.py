"""The request-path question: the launch storm exactly as the request-path issue states it
(``bench.storm_lean``: 17 requests per group, 4 KiB agents, 64 in flight), on the same machine
in one run, against:

- the registry on its default SQLite store, served by its own uvicorn server;
- the same registry app served by Granian (a Rust HTTP server; ``bench.granian_app``), to
  choose the server by numbers;
- the framework's floor (``bench.minimal routes``: the same four routes and request models,
  no work) on the registry's uvicorn settings;
- etcd direct (aetcd), the same key operations;
- the registry's batched routes (a leader per group, 3 requests per group).

Each row runs ``ROUNDS`` times, interleaved (a burst of load from elsewhere hits every system
alike); the table shows the median round by ready time, the JSON keeps every round. Server
CPU is the process tree's (Granian serves from a child process); the main process's event
loop thread and its other threads (the SQLite file's) are shown apart.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import HOST, Server, free_port, process, registry_server, say, wait_http
from bench.storm_lean import lean_batched, lean_etcd, lean_http

ROUNDS = 5
SYSTEMS = ("registry", "registry_granian", "floor", "etcd_direct", "registry_batched")


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [pid, *(int(p) for p in out.stdout.split())]


def _ticks(path: str) -> float:
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds of the main thread (the event loop's) and of all other threads (for the
    registry on uvicorn: the SQLite file's thread; uvloop's idle DNS workers use none)."""
    out = {"event_loop": 0.0, "other_threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        key = "event_loop" if int(tid) == pid else "other_threads"
        out[key] += _ticks(f"/proc/{pid}/task/{tid}/stat")
    return out


def _measured(url: Server, storm: Callable[[str, int], dict[str, Any]], n: int) -> dict[str, Any]:
    """One storm, with the server process tree's CPU and, per thread, the main process's."""
    pids = _tree(url.pid)
    before = sum(_ticks(f"/proc/{p}/stat") for p in pids)
    threads = _threads(url.pid)
    plain = Server(str(url))  # no pid: the storm's own accounting is replaced by this one
    row = storm(plain, n)
    row["server_cpu_s"] = round(sum(_ticks(f"/proc/{p}/stat") for p in pids) - before, 3)
    after = _threads(url.pid)
    row["server_threads_cpu_s"] = {k: round(v - threads[k], 3) for k, v in after.items()}
    row["server_cpu_ms_per_request"] = round(row["server_cpu_s"] / row["requests"] * 1000, 3)
    return row


@contextmanager
def _granian(tmp: Path, name: str) -> Iterator[Server]:
    port = free_port()
    env = {"REGISTRY_STORE": f"sqlite:///{tmp / name}.db"}
    cmd = [
        sys.executable,
        "-m",
        "granian",
        "--interface",
        "asgi",
        "--factory",
        "--loop",
        "uvloop",
        "--workers",
        "1",
        "--runtime-threads",
        "1",
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        "bench.granian_app:app",
    ]
    with process(cmd, env=env, log=tmp / f"{name}.log") as proc:
        url = Server(f"http://{HOST}:{port}")
        url.pid = proc.pid
        wait_http(f"{url}/healthz", 30.0, proc)
        yield url


@contextmanager
def _floor(tmp: Path) -> Iterator[Server]:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.minimal", "routes", str(port)]
    with process(cmd, log=tmp / "floor.log") as proc:
        url = Server(f"http://{HOST}:{port}")
        url.pid = proc.pid
        wait_http(f"{url}/docs", 30.0, proc)
        yield url


def _one(system: str, n: int, tmp: Path, tag: str, etcd: str | None) -> dict[str, Any]:
    try:
        if system == "etcd_direct":
            if etcd is None:
                return {"failed": "no etcd binary"}
            return lean_etcd(etcd, n)
        if system == "floor":
            with _floor(tmp) as url:
                return _measured(url, lean_http, n)
        if system == "registry_granian":
            with _granian(tmp, tag) as url:
                return _measured(url, lean_http, n)
        storm = lean_batched if system == "registry_batched" else lean_http
        with registry_server(f"sqlite:///{tmp / tag}.db", log=tmp / f"{tag}.log") as url:
            return _measured(url, storm, n)
    except Exception as exc:  # recorded; the other rows still run
        return {"failed": f"{type(exc).__name__}: {exc}"[:300]}


def run(quick: bool = False) -> dict[str, Any]:
    from harness.etcd import EtcdCluster, etcd_available

    sizes = [256] if quick else [1024, 4096]
    rounds = 1 if quick else ROUNDS
    out: dict[str, Any] = {"sizes": sizes, "rounds": rounds, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="bench-lean-") as name:
        tmp = Path(name)
        cluster = EtcdCluster(tmp / "etcd", size=1).start() if etcd_available() else None
        try:
            endpoint = cluster.endpoints[0] if cluster else None
            for n in sizes:
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
                for r in range(rounds):
                    for system in SYSTEMS:
                        row = _one(system, n, tmp, f"{system}-{n}-{r}", endpoint)
                        runs[system].append(row)
                        shown = row.get("failed") or f"{row['ready_s']} s to ready"
                        say(f"  lean storm, {n} ranks, {system}, round {r + 1}: {shown}")
                out["rows"][str(n)] = {s: _median(v) | {"rounds": v} for s, v in runs.items()}
        finally:
            if cluster is not None:
                cluster.stop()
    return out


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rounds if "failed" not in r]
    if not ok:
        return dict(rounds[0])
    middle = statistics.median_low([r["ready_s"] for r in ok])
    return dict(next(r for r in ok if r["ready_s"] == middle))
