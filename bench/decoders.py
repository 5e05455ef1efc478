"""``python -m bench.decoders [--ranks 100000] [--store sqlite|etcd] [--streams N]``: the
registry's watch at fleet scale, followed as the vLLM plugin's decoders follow it.

A fleet of TP 8 groups (half prefill, half decode: ``bench/fleet_load.py``, its launch and its
heartbeats through the batched per-node routes) on one SQLite registry, or on two registry
replicas of a 3-member etcd. One stream a decode node (``ranks / 16`` by default), as one
node's leader asks (`workers.vllm_plugin.node_follow`: ``model=<the fleet's model>``, no role
filter), in ``--procs`` client processes (``bench/decoder_streams.py``, raw asyncio), each
started at the revision of one list (a node's own first list is not part of this: 6,250
lists of 12,500 groups). Per row:

- **steady**: the registry's CPU (share of a core) and RSS over a window without the streams
  and one with them (the fleet's heartbeats in both), KiB a stream; the clients' CPU;
- **relaunch**: ``--relaunches`` prefill relaunches (a new ``launch_id`` on one of the
  writer's prefill groups of the model), spaced: from each answer to each stream's line of
  it, p50/p99/max, with the clients' loop lag;
- **restart**: a writer relaunches its groups every 0.25 s before, during and after the
  registry's restart (SQLite: SIGTERM, start again on the same file; etcd: SIGKILL one of the
  two replicas, the streams' first URL, they resume on the other); then every stream must
  have seen every generation written after its start exactly once, in order (a relist, after
  ``410``, covers what it shows and is counted), the reconnects' most in any one second, and
  when every stream was back;
- **ceiling**: the same clients against ``python -m bench.watch ceiling`` (a raw server
  that writes one line to every stream a PUT), the same relaunch count: the clients' floor.

Figures to ``bench/results/decoders.json`` (``bench.run``) or stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench import report_decoders as check
from bench.common import HOST, cpu_seconds, etcd_store_available, process, say
from bench.decoder_clients import Clients
from bench.fleet import BLOB_BYTES, REGIONS, _etcd
from bench.fleet_load import TP, Fleet, fleet_run
from bench.storm_core import COMPAT
from bench.watch import rss_mib, wait_http_tcp
from workers.tools.procs import RegistryProcess, free_port

PREFIX = "w-"  # the writer's groups
WRITER_GROUPS = 8
RESTART_WRITE_S = 0.25


class Writer:
    """Relaunches prefill groups of the fleet's model; records each generation's answer."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.gids = [f"{PREFIX}prefill-{k}" for k in range(WRITER_GROUPS)]
        self.writes: list[check.Write] = []

    def relaunch(self, gid: str, deadline_s: float = 300) -> check.Write:
        """A new launch_id, sent again with the same id until answered (a relaunch whose
        answer was lost in the restart is the same generation when sent again)."""
        body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": "prefill", "compat": COMPAT}
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                r = self.http.put(f"/tp-groups/{gid}/engine", json=body)
                if r.status_code in (200, 201):
                    write = (gid, int(r.json()["generation"]), time.monotonic())
                    self.writes.append(write)
                    return write
                why = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                why = repr(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"relaunch of {gid} not answered in {deadline_s} s: {why}")
            time.sleep(0.05)

    def final(self) -> dict[str, int]:
        """The last generation of each group relaunched since the streams started."""
        out: dict[str, int] = {}
        for gid, gen, _ in self.writes[WRITER_GROUPS:]:
            out[gid] = max(gen, out.get(gid, 0))
        return out


def _marks(pids: dict[str, int], clients: Clients | None) -> dict[str, Any]:
    return {
        "cpu": {k: cpu_seconds(p) for k, p in pids.items()},
        "t": time.monotonic(),
        "clients": clients.ask("mark") if clients else [],
    }


def _window(a: dict[str, Any], b: dict[str, Any], pids: dict[str, int]) -> dict[str, Any]:
    span = b["t"] - a["t"]
    out: dict[str, Any] = {
        f"{k}_core_share": round((b["cpu"][k] - a["cpu"][k]) / span, 3) for k in pids
    }
    out["rss_mib"] = rss_mib(pids["server"])
    if b["clients"]:
        used = sum(y["cpu_s"] - x["cpu_s"] for x, y in zip(a["clients"], b["clients"], strict=True))
        out["client_core_share"] = round(used / span, 3)
        out["client_lag_p99_ms"] = max(c["lag"]["p99_ms"] for c in b["clients"])
    return out


def phases(
    row: dict[str, Any],
    serving: RegistryProcess,
    others: list[RegistryProcess],
    writer_url: str,
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, Any]:
    """After the fleet's window without streams: the streams, their window, the relaunches,
    the restart (``serving`` is the streams' replica; it is the one stopped)."""
    writer = Writer(writer_url)
    for gid in writer.gids:
        writer.relaunch(gid)
    revision = int(writer.http.get("/tp-groups", params={"limit": 1}).json()["revision"])
    urls = [serving.url] + [o.url for o in others]
    extra = ("--resume-at-error",) if args.resume_at_error else ()
    clients = Clients(urls, revision, args.streams, args.procs, tmp, PREFIX, extra)
    try:
        pids = {"server": serving.pid} | {f"replica{k}": o.pid for k, o in enumerate(others)}
        time.sleep(5)
        a = _marks(pids, clients)
        time.sleep(args.window)
        row["steady"]["with"] = _window(a, _marks(pids, clients), pids)
        grew = row["steady"]["with"]["rss_mib"] - row["steady"]["without"]["rss_mib"]
        row["steady"]["kib_per_stream"] = round(grew * 1024 / args.streams, 1)
        say(f"decoders: steady {row['steady']}")
        a = _marks(pids, clients)
        relaunches = [writer.relaunch(writer.gids[k % WRITER_GROUPS]) for k in range(1)]
        for k in range(1, args.relaunches):
            time.sleep(args.spacing)
            relaunches.append(writer.relaunch(writer.gids[k % WRITER_GROUPS]))
        reached = clients.ask(f"wait {json.dumps(writer.final())} 60", 90)
        b = _marks(pids, clients)
        seen = clients.dump()
        rel = check.latencies(seen["records"], relaunches)
        rel |= {"reached_all": all(r["ok"] for r in reached), **_window(a, b, pids)}
        row["relaunch"] = rel
        say(f"decoders: relaunch {rel}")
        row["restart"] = _restart(serving, others, writer, clients, args.pause_writes)
    finally:
        clients.close()
        writer.http.close()
    return {}


def _restart(
    serving: RegistryProcess,
    others: list[RegistryProcess],
    writer: Writer,
    clients: Clients,
    pause_writes: bool,
) -> dict[str, Any]:
    stop = threading.Event()
    failed: list[str] = []

    hold, busy = threading.Event(), threading.Lock()

    def write() -> None:
        k = 0
        try:
            while not stop.is_set():
                with busy:
                    if not hold.is_set():
                        writer.relaunch(writer.gids[k % WRITER_GROUPS])
                        k += 1
                stop.wait(RESTART_WRITE_S)
        except RuntimeError as exc:
            failed.append(str(exc))

    before = len(writer.writes)
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    time.sleep(2)
    if pause_writes:  # none in the shutdown: the streams have every write before it
        with busy:
            hold.set()
        time.sleep(1)
    t_kill = time.monotonic()
    if others:  # etcd: the streams' replica dies, the others serve on
        serving.kill()
        t_up = time.monotonic()
        down = {"how": "SIGKILL one of two replicas", "stop_s": round(t_up - t_kill, 2)}
    else:
        serving.stop()
        stopped = time.monotonic()
        serving.start(timeout_s=300)
        t_up = time.monotonic()
        down = {
            "how": "SIGTERM, start on the same file",
            "stop_s": round(stopped - t_kill, 2),
            "start_s": round(t_up - stopped, 2),
        }
    hold.clear()
    time.sleep(10)
    stop.set()
    thread.join(timeout=330)
    reached = clients.ask(f"wait {json.dumps(writer.final())} 120", 150)
    seen = clients.dump()
    out = {
        **down,
        "writes_in_shutdown": not pause_writes,
        "writes": len(writer.writes) - before,
        "writer_failed": failed,
        "reached_all": all(r["ok"] for r in reached),
        "behind": sum(r["behind"] for r in reached),
        "check": check.exactly_once(seen["records"], writer.writes[WRITER_GROUPS:]),
        "relists": seen["relists"],
        "raw_duplicates_dropped": seen["duplicates"],
        "stream_ends": seen["ends"],
        "reconnects": check.reconnects(seen["attempts"], seen["opens"], t_kill, t_up),
    }
    say(f"decoders: restart {out}")
    return out


def ceiling(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The clients against a server that does nothing but write one line to every stream."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.watch", "ceiling", str(port)]
    with process(cmd, log=tmp / "ceiling.log") as proc:
        wait_http_tcp(HOST, port, 30)
        url = f"http://{HOST}:{port}"
        clients = Clients([url], 0, args.streams, args.procs, tmp, prefix="fan-")
        try:
            time.sleep(2)
            a = _marks({"server": proc.pid}, clients)
            answers = []
            with httpx.Client(base_url=url, timeout=30) as http:
                for _ in range(args.relaunches):
                    http.put("/x", json={})
                    answers.append(time.monotonic())
                    time.sleep(args.spacing)
            out = _window(a, _marks({"server": proc.pid}, clients), {"server": proc.pid})
            seen = clients.dump()
        finally:
            clients.close()
    out["relaunch"] = check.by_revision(seen["records"], answers)
    say(f"decoders: ceiling {out}")
    return out


def without(marks: list[dict[str, Any]], pids: dict[str, int], row: dict[str, Any]) -> None:
    """The fleet's window without streams: its ends."""
    marks.append(_marks(pids, None))
    if len(marks) == 2:
        row["steady"]["without"] = _window(marks[0], marks[1], pids)


def one_row(store: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    # A watch holds a connection, and REGISTRY_WATCH_MAX must stay below the connections' cap.
    watches = args.streams + 256
    env = {
        "REGISTRY_WATCH_MAX": str(watches),
        "REGISTRY_MAX_CONNECTIONS": str(max(8192, watches + 1024)),
    }
    log = tmp / "registry.log"
    serving = RegistryProcess(store, host=HOST, env=env, log_path=log).start(timeout_s=60)
    others = []
    if args.store == "etcd":  # the fleet and the writer on the second replica
        log2 = tmp / "registry2.log"
        others.append(RegistryProcess(store, host=HOST, env=env, log_path=log2).start(timeout_s=60))
    fleet_url = (others or [serving])[0].url
    row: dict[str, Any] = {
        "load_before": Path("/proc/loadavg").read_text().split()[:3],
        "store": args.store,
        "ranks": args.ranks,
        "groups": args.ranks // TP,
        "streams": args.streams,
        "client_procs": args.procs,
        "resume_at_error": args.resume_at_error,
        "filter": {"model": COMPAT["model"]},
        "steady": {},
    }
    marks: list[dict[str, Any]] = []
    pids = {"server": serving.pid} | {f"replica{k}": o.pid for k, o in enumerate(others)}
    try:
        out = asyncio.run(
            fleet_run(
                fleet_url,
                Fleet(args.ranks, BLOB_BYTES, REGIONS),
                warmup_s=5.0,
                window_s=args.window,
                handshakes_per_s=0,
                on_window=lambda _: without(marks, pids, row),
                after_window=lambda: phases(row, serving, others, fleet_url, args, tmp),
            )
        )
    finally:
        serving.stop()
        for o in others:
            o.stop()
    row["launch"] = {k: out["launch"][k] for k in ("ready_s", "errors")}
    row["fleet_heartbeats"] = {k: out["steady"][k] for k in ("heartbeat", "client_lag")}
    row["after_window_statuses"] = out["after_window_statuses"]
    return row


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-decoders-") as name:
        tmp = Path(name)
        try:
            if args.store == "etcd":
                ok, why = etcd_store_available()
                if not ok:
                    return {"ranks": args.ranks, "failed": f"skipped: {why}"}
                with _etcd(tmp) as cluster:
                    row = one_row(cluster.url(f"dec{args.ranks}"), args, tmp)
            else:
                row = one_row(f"sqlite:///{tmp}/fleet.db", args, tmp)
            row["ceiling"] = ceiling(args, tmp)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
            log = tmp / "registry.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            why = f"{type(exc).__name__}: {exc}"[:500]
            return {"ranks": args.ranks, "failed": why, "log": tail}
    row["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    return row


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.decoders", description=__doc__)
    parser.add_argument("--ranks", type=int, default=100_000, help="the fleet's ranks (TP 8)")
    parser.add_argument("--store", choices=("sqlite", "etcd"), default="sqlite")
    parser.add_argument("--streams", type=int, default=0, help="default: one a decode node")
    parser.add_argument("--procs", type=int, default=2, help="stream client processes")
    parser.add_argument("--relaunches", type=int, default=20)
    parser.add_argument("--spacing", type=float, default=1.0, help="seconds between them")
    parser.add_argument("--window", type=float, default=20.0, help="each steady window, s")
    parser.add_argument(
        "--pause-writes",
        action="store_true",
        help="no relaunch from the SIGTERM until the registry serves again (SQLite: a write "
        "in the shutdown makes every stream relist the fleet)",
    )
    parser.add_argument(
        "--resume-at-error",
        action="store_true",
        help="the clients resume from a final ERROR line's revision (registry_client.watch, so the "
        "plugin, resumes from its last event's revision minus one: 410 on a restarted SQLite)",
    )
    args = parser.parse_args(argv)
    args.streams = args.streams or args.ranks // TP // 2
    return args


def run(quick: bool = False) -> dict[str, Any]:
    """``bench.run``'s row: 100,000 ranks on SQLite (no write in the restart's shutdown: one
    makes every stream relist the whole fleet, hours at this size), 10,000 on SQLite with
    writes through it, 10,000 on etcd. Quick: 1,000 on SQLite, 3 relaunches."""
    rows: dict[str, list[dict[str, Any]]] = {"sqlite": [], "etcd": []}
    quiet = ["--pause-writes", "--resume-at-error"]
    plan = [("sqlite", 100_000, quiet), ("sqlite", 10_000, []), ("etcd", 10_000, [])]
    if quick:
        plan = [("sqlite", 1000, ["--relaunches", "3", "--window", "3"])]
    for store, ranks, extra in plan:
        args = parse(["--store", store, "--ranks", str(ranks), *extra])
        say(f"decoders: {store}, {args.ranks} ranks, {args.streams} streams")
        rows[store].append(measure(args))
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(json.dumps(measure(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
