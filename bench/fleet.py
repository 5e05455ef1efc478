"""``python -m bench.fleet [--quick] [--ranks 1000,10000,100000] [--store sqlite,etcd]
[--regions R]``: a whole fleet on one registry, measured at each size.

Per size (TP 8 groups, half prefill and half decode, ``bench/fleet_load.py``): the launch
through the batched per-node routes (time until every rank is registered), then a steady
state of per-node heartbeats at the library's default pace (every 10 s under a 30 s lease)
with decode leaders planning against random prefill engines, then the reads an operator
makes (a page of 500 groups, the status page), then a restart of the registry on the same
store (SIGTERM, start, until a group's engine and a heartbeat are answered again).

Reported per row: ready time, the server's CPU in the launch (seconds) and in the steady
state (a share of one core), and of each its event loop's thread's (``server_loop_*``: near
1, the loop is the limit); the launch's ``machine_busy_share`` of every core (near 1, the
machine is); p50/p99 of heartbeats and handshakes with the client's own lag and CPU beside
them, the server's RSS, the store's size (SQLite: the file and its WAL; etcd: each member's
database and the leases it holds), and the restart. The blobs are the size
``docs/benchmarks.md`` derives for a 70B model at TP 8 (``REGIONS`` registered regions a
rank, ``blob_bytes``).
The client's ceiling: the same steady state against ``bench.minimal raw`` (no work).
Nothing is asserted; figures go to ``bench/results/fleet.json`` (``bench.run``) or stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    HOST,
    busy_share,
    cpu_seconds,
    cpu_times,
    etcd_cpu_s,
    etcd_store_available,
    loop_cpu_seconds,
    process,
    say,
    wait_http,
    wait_quiet,
)
from bench.fleet_load import CONNECTIONS, TP, Fleet, fleet_run
from bench.watch import rss_mib
from workers.tools.procs import RegistryProcess, free_port

# NIXL's agent metadata, measured (bench/blob_size.py: UCX, this host, nixl 1.5.1): about
# 410 + 44 bytes a registered region. A 70B Llama-shaped model at TP 8 registers 1 region a
# rank in vLLM 0.32 (one KV-cache tensor for all layers) and 80 with one tensor a layer: the
# larger is used (docs/benchmarks.md has the derivation).
REGIONS = 80


BLOB = "nixl"  # the fleet's blobs: "nixl" (real agents' metadata) or "random" (bytes)
_SAMPLES: dict[int, list[bytes]] = {}


def fleet_blobs() -> list[bytes]:
    """Real NIXL metadata of ``REGIONS`` regions (16 agents' on DRAM, made once a run) for
    ``BLOB`` "nixl"; none (random bytes of ``BLOB_BYTES``) for "random"."""
    if BLOB == "random":
        return []
    if REGIONS not in _SAMPLES:
        from bench.blob_size import samples

        _SAMPLES[REGIONS] = samples(REGIONS)
    return _SAMPLES[REGIONS]


def blob_bytes(regions: int) -> int:
    """NIXL's agent metadata for ``regions`` registered regions (``bench/blob_size.py``)."""
    return 408 + 44 * regions


BLOB_BYTES = blob_bytes(REGIONS)
HANDSHAKES_PER_S = 20.0
QUIET_WAIT_S = 180.0  # before each row: wait (this long at most) for other work to go idle
# etcd as documented in docs/benchmarks.md: 8 GiB quota (etcd's suggested maximum), history
# compacted hourly (the registry's watch history lives in its own log, not etcd's).
ETCD_ENV = {"ETCD_QUOTA_BACKEND_BYTES": str(8 << 30), "ETCD_AUTO_COMPACTION_RETENTION": "1"}


def _store_bytes(db: Path | None) -> int:
    if db is None:
        return 0
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())


def _etcd_requests(cluster: Any) -> dict[str, float]:
    """gRPC messages received so far by each method, on the store's preferred member (every
    call goes there while it answers): a stream's messages each count."""
    text = httpx.get(f"{cluster.members[0].client_url}/metrics", timeout=5).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
            counts[method] = counts.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _etcd_load(cluster: Any) -> tuple[dict[str, float], float] | None:
    """etcd's requests so far (``_etcd_requests``) and every member's CPU seconds; None
    without etcd."""
    if cluster is None:
        return None
    return _etcd_requests(cluster), etcd_cpu_s(cluster)


def _sent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Requests by method between two counts (methods that received any)."""
    return {m: after[m] - before.get(m, 0.0) for m in after if after[m] > before.get(m, 0.0)}


def _etcd_status(cluster: Any) -> dict[str, Any]:
    status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json"))
    sizes = [s["Status"]["dbSize"] for s in status]
    in_use = [s["Status"].get("dbSizeInUse", 0) for s in status]
    leases = cluster.etcdctl("lease", "list").splitlines()
    return {
        "db_mib": [round(b / 2**20, 1) for b in sizes],
        "db_in_use_mib": [round(b / 2**20, 1) for b in in_use],
        "leases": max(0, len(leases) - 1),  # the first line is "found N leases"
        "members": len(status),
    }


def _reads(url: str) -> dict[str, Any]:
    """``bench.fleet_reads`` in a process of its own (its module doc says why)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.fleet_reads", url],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    reads: dict[str, Any] = json.loads(done.stdout)
    return reads


def _restart(registry: RegistryProcess, fleet: Fleet) -> dict[str, Any]:
    """SIGTERM, start on the same port and store; until a group's engine reads ready and its
    heartbeat is answered 200 (the store loaded and serving)."""
    gid, eid = next(iter(fleet.engines.items()))
    t_stop = time.perf_counter()
    registry.stop()
    stopped = time.perf_counter() - t_stop
    t0 = time.perf_counter()
    registry.start(timeout_s=300)
    healthz = time.perf_counter() - t0
    body = {"engine_id": eid, "ranks": list(range(TP))}
    with httpx.Client(base_url=registry.url, timeout=60) as c:
        while time.perf_counter() - t0 < 300:
            with contextlib.suppress(httpx.HTTPError):
                engine = c.get(f"/tp-groups/{gid}/engine")
                beat = c.post(f"/tp-groups/{gid}/engine/agents/heartbeat", json=body)
                if engine.status_code == 200 and engine.json()["ready"] and beat.is_success:
                    break
            time.sleep(0.05)
    return {
        "stop_s": round(stopped, 2),
        "healthz_s": round(healthz, 2),
        "serving_s": round(time.perf_counter() - t0, 2),
    }


def stream_env(groups: int) -> dict[str, str]:
    """A registry sized for one keep-alive stream a node (docs/operations.md: the streams
    above the nodes it serves, the connections above the streams and the REST pool)."""
    streams = groups + 64
    return {
        "REGISTRY_KEEPALIVE_MAX": str(streams),
        "REGISTRY_MAX_CONNECTIONS": str(max(8192, streams + CONNECTIONS + 1024)),
    }


# (warmup, window) of the steady state, seconds (``--hold``); None: by ``quick``.
HOLD: tuple[float, float] | None = None


def one_row(
    store: str,
    ranks: int,
    *,
    db: Path | None,
    cluster: Any,
    quick: bool,
    log: Path,
    renew: str = "rest",
) -> dict[str, Any]:
    fleet = Fleet(ranks, BLOB_BYTES, REGIONS, blobs=fleet_blobs())
    warmup, window = HOLD or ((3.0, 5.0) if quick else (10.0, 30.0))
    env = stream_env(ranks // TP) if renew == "stream" else {}
    idle_etcd = None
    if cluster is not None:  # etcd's own CPU with no registry on it (3 members' raft ticks)
        before = etcd_cpu_s(cluster)
        time.sleep(5.0)
        idle_etcd = round((etcd_cpu_s(cluster) - before) / 5, 3)
    registry = RegistryProcess(store, host=HOST, log_path=log, env=env).start(timeout_s=60)
    marks: list[float] = []
    loop_marks: list[float] = []
    etcd_marks: list[tuple[dict[str, float], float]] = []
    seen: dict[str, Any] = {}

    def after_window() -> dict[str, Any]:
        seen["rss_steady"] = rss_mib(registry.pid)
        seen["reads"] = _reads(registry.url)
        seen["store"] = (
            _etcd_status(cluster) if cluster is not None else {"bytes": _store_bytes(db)}
        )
        seen["restart"] = _restart(registry, fleet)
        return {}

    try:
        pid = registry.pid
        rss_empty = rss_mib(pid)
        cpu0, loop0, ticks0 = cpu_seconds(pid), loop_cpu_seconds(pid), cpu_times()
        etcd0 = _etcd_load(cluster)

        def on_ready() -> dict[str, Any]:
            """The launch's cost: the registry's CPU (of it, its event loop's thread), the
            machine's busy share of its cores, and etcd's (every member's CPU, the requests
            it received by method)."""
            figures: dict[str, Any] = {
                "server_cpu_s": round(cpu_seconds(pid) - cpu0, 2),
                "server_loop_cpu_s": round(loop_cpu_seconds(pid) - loop0, 2),
                "machine_busy_share": round(busy_share(ticks0, cpu_times()), 3),
            }
            now = _etcd_load(cluster)
            if etcd0 is not None and now is not None:
                (msgs0, ecpu0), (msgs1, ecpu1) = etcd0, now
                figures["etcd_cpu_s"] = round(ecpu1 - ecpu0, 2)
                figures["etcd_requests"] = _sent(msgs0, msgs1)
            return figures

        def on_window(start: bool) -> None:
            if start:
                seen["rss_ready"] = rss_mib(pid)
            marks.append(cpu_seconds(pid))
            loop_marks.append(loop_cpu_seconds(pid))
            load = _etcd_load(cluster)  # etcd's own: requests received, every member's CPU
            if load is not None:
                etcd_marks.append(load)

        out = asyncio.run(
            fleet_run(
                registry.url,
                fleet,
                warmup_s=warmup,
                window_s=window,
                handshakes_per_s=HANDSHAKES_PER_S,
                on_window=on_window,
                after_window=after_window,
                on_ready=on_ready,
                renew=renew,
            )
        )
    finally:
        registry.stop()
    up, hold = out["launch"], out["steady"]
    up["server_cpu_s_to_window"] = round(marks[0] - cpu0, 2)
    up["server_loop_share"] = round(up["server_loop_cpu_s"] / max(0.01, up["ready_s"]), 3)
    hold["server_core_share"] = round((marks[1] - marks[0]) / window, 3)
    hold["server_loop_share"] = round((loop_marks[1] - loop_marks[0]) / window, 3)
    work = (hold["heartbeats_per_s"] + hold["handshakes_per_s"]) * window
    hold["server_cpu_us_per_request"] = round((marks[1] - marks[0]) / max(1, work) * 1e6)
    if etcd_marks:
        (msgs0, ecpu0), (msgs1, ecpu1) = etcd_marks
        sent = _sent(msgs0, msgs1)
        hold["etcd_requests_per_s"] = round(sum(sent.values()) / window)
        hold["etcd_requests_per_heartbeat"] = round(
            sum(sent.values()) / max(1.0, hold["heartbeats_per_s"] * window), 2
        )
        hold["etcd_requests_per_s_by_method"] = {m: round(n / window) for m, n in sent.items()}
        hold["etcd_core_share"] = round((ecpu1 - ecpu0) / window, 3)
        hold["etcd_core_share_idle"] = idle_etcd
    return {
        "ranks": ranks,
        "groups": ranks // TP,
        "renew": renew,
        "registry_env": env,
        "streams": out.get("streams"),
        "blob_bytes": BLOB_BYTES,
        "launch": up,
        "steady": hold,
        "after_window_statuses": out["after_window_statuses"],
        "reads": seen["reads"],
        "rss_mib": {"empty": rss_empty, "ready": seen["rss_ready"], "steady": seen["rss_steady"]},
        "store": seen["store"],
        "restart": seen["restart"],
    }


def ceiling(ranks: int, quick: bool, kind: str = "raw") -> dict[str, Any]:
    """The same steady state against a server that answers without work: the client's own
    latency and CPU at this pace, and the server's (``raw``: uvicorn with the registry's
    settings and a bare ASGI callable, the floor of a request through uvicorn; ``protocol``:
    an asyncio protocol with httptools, no uvicorn, the floor of the registry's wire path)."""
    port = free_port()
    fleet = Fleet(ranks, BLOB_BYTES, REGIONS)
    fleet.engines = {g: f"e-{g}" for g in fleet.groups}
    warmup, window = (3.0, 5.0) if quick else (10.0, 30.0)
    url = f"http://{HOST}:{port}"
    marks: list[float] = []
    with process([sys.executable, "-m", "bench.minimal", kind, str(port)]) as proc:
        wait_http(url + "/", 30, proc)
        out = asyncio.run(
            fleet_run(
                url,
                fleet,
                warmup_s=warmup,
                window_s=window,
                handshakes_per_s=HANDSHAKES_PER_S,
                launch=False,
                on_window=lambda _: marks.append(cpu_seconds(proc.pid)),
            )
        )
    steady = dict(out["steady"])
    requests = (steady["heartbeats_per_s"] + steady["handshakes_per_s"]) * window
    steady["server_core_share"] = round((marks[1] - marks[0]) / window, 3)
    steady["server_cpu_us_per_request"] = round((marks[1] - marks[0]) / max(1, requests) * 1e6)
    return steady


@contextlib.contextmanager
def _etcd(tmp: Path, size: int = 3) -> Iterator[Any]:
    """A real etcd of ``size`` members under ``tmp`` with a fleet's settings (``ETCD_ENV``)."""
    import os

    from harness.etcd import EtcdCluster

    saved = {k: os.environ.get(k) for k in ETCD_ENV}
    os.environ.update(ETCD_ENV)
    try:
        with EtcdCluster(tmp / "etcd", size=size) as cluster:
            yield cluster
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(
    sizes: list[int],
    stores: list[str],
    quick: bool,
    renews: tuple[str, ...] = ("rest",),
    ceilings: bool = True,
) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as name:
        tmp = Path(name)
        for kind in stores:
            if kind == "etcd":
                ok, why = etcd_store_available()
                if not ok:
                    skipped["etcd"] = why
                    continue
            rows[kind] = []
            for n, renew in ((n, r) for n in sizes for r in renews):
                busy = wait_quiet(0 if quick else QUIET_WAIT_S)
                load = Path("/proc/loadavg").read_text().split()[:3]
                say(f"fleet: {kind}, {n} ranks, {renew} (machine {busy:.0%} busy, load {load})")
                log = tmp / f"registry-{kind}-{n}-{renew}.log"
                try:
                    if kind == "sqlite":
                        db = tmp / f"fleet-{n}-{renew}.db"
                        row = one_row(
                            f"sqlite:///{db}",
                            n,
                            db=db,
                            cluster=None,
                            quick=quick,
                            log=log,
                            renew=renew,
                        )
                    else:
                        with _etcd(tmp / f"etcd-{n}-{renew}") as cluster:
                            row = one_row(
                                cluster.url(f"fleet{n}"),
                                n,
                                db=None,
                                cluster=cluster,
                                quick=quick,
                                log=log,
                                renew=renew,
                            )
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                    failed = f"{type(exc).__name__}: {exc}"[:500]
                    row = {"ranks": n, "renew": renew, "failed": failed, "log": tail}
                row |= {
                    "busy_before": busy,
                    "load_before": load,
                    "load_after": Path("/proc/loadavg").read_text().split()[:3],
                }
                say(f"fleet: {kind}, {n} ranks: {json.dumps(row)}")
                rows[kind].append(row)
        top: dict[str, Any] = {}
        if ceilings:
            say("fleet: the client's ceiling (bench.minimal raw)")
            top = ceiling(max(sizes), quick)
            say("fleet: the wire path's floor (bench.minimal protocol)")
            top["protocol"] = ceiling(max(sizes), quick, "protocol")
    return {
        "rows": rows,
        "skipped": skipped,
        "ceiling": {"ranks": max(sizes), **top},
        "regions": REGIONS,
        "blob_bytes": BLOB_BYTES,
        "blob": BLOB,
        "handshakes_per_s": HANDSHAKES_PER_S,
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [1000, 4000] if quick else [1000, 10_000, 100_000]
    return measure(sizes, ["sqlite", "etcd"], quick)


def _set_blob(kind: str) -> None:
    global BLOB
    BLOB = kind


def _set_regions(regions: int) -> None:
    """Every row's ranks register ``regions`` regions (the blobs' size follows)."""
    global REGIONS, BLOB_BYTES
    REGIONS, BLOB_BYTES = regions, blob_bytes(regions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, short windows")
    parser.add_argument("--ranks", default="", help="comma-separated fleet sizes (ranks)")
    parser.add_argument("--store", default="sqlite,etcd", help="sqlite, etcd or both")
    parser.add_argument(
        "--renew",
        default="rest",
        help="rest, stream or both (a row each): how nodes renew (bench/fleet_load.py)",
    )
    parser.add_argument(
        "--no-ceiling", action="store_true", help="skip the client's ceiling and the floor"
    )
    parser.add_argument(
        "--hold",
        default="",
        help="WARMUP,WINDOW seconds of the steady state (lazy etcd renewals settle after "
        "REGISTRY_ETCD_RENEW_WINDOW_S)",
    )
    parser.add_argument(
        "--regions",
        type=int,
        default=REGIONS,
        help=f"NIXL regions a rank ({REGIONS}: a tensor a layer; vLLM 0.32 registers 1)",
    )
    parser.add_argument(
        "--blob",
        choices=("nixl", "random"),
        default="nixl",
        help="the ranks' metadata: real NIXL agents' (on DRAM) or random bytes of its size",
    )
    args = parser.parse_args(argv)
    _set_blob(args.blob)
    if args.regions < 1:
        parser.error("--regions is at least 1")
    _set_regions(args.regions)
    if args.hold:
        global HOLD
        warmup, window = (float(x) for x in args.hold.split(","))
        HOLD = (warmup, window)
    renews = tuple(r.strip() for r in args.renew.split(",") if r.strip())
    if not renews or set(renews) - {"rest", "stream"}:
        parser.error(f"--renew {args.renew!r}: rest, stream or rest,stream")
    sizes = [int(n) for n in args.ranks.split(",") if n.strip()] or (
        [1000, 4000] if args.quick else [1000, 10_000, 100_000]
    )
    stores = [s.strip() for s in args.store.split(",") if s.strip()]
    result = measure(sizes, stores, args.quick, renews, ceilings=not args.no_ceiling)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
