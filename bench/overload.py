"""``python -m bench.overload [--quick] [--ranks N] [--surge-s S] [--times X]
[--seats-baseline]``: a fleet on one SQLite registry past its capacity: the steady state, a
surge of reads beside it, the way back, and a restart (``docs/operations.md``, "Overload").

1. **Launch and steady state**: ``bench/fleet_load.py``'s fleet (TP 8 groups, a node
   heartbeat every 10 s under a 30 s lease, 20 handshakes a second): ready time, the
   registry's CPU in a 30 s window, heartbeat p50/p99.
2. **Surge**: the cost of one read of each flood path is measured on the quiet registry (its
   CPU before and after), then ``--times`` (3) cores' worth of those reads are offered for
   ``--surge-s`` seconds at a fixed rate (open loop: ``FLOOD_PROCS`` processes, each request
   sent on schedule whatever came back, at most ``FLOOD_IN_FLIGHT`` in flight a process; a
   request past that is counted as not sent), while the fleet's heartbeats go on and
   ``PROBES`` groups are also renewed every 0.25 s from another process's view (a thread with
   its own connection): their latency is the heartbeat's under overload. Reported: the
   registry's CPU share, the reads served and shed (503 with ``Retry-After``), the probes'
   p50/p99/max against the ``BUDGET_S`` budget, heartbeats answered 404 (lapsed leases).
3. **Back**: the registry's CPU share every 5 s after the surge, until it is within
   ``BACK_MARGIN`` of the steady figure (at most 60 s): the time that took.
4. **Restart**: SIGTERM, start on the same file; the fleet's heartbeats answered each second
   after it serves again (the largest second: the reconnects' peak), 404s (lapses), and the
   time until as many heartbeats were answered 200 as there are nodes (each node beats once
   every 10 s, so that is when every node has renewed, give or take a node that beat twice).

Nothing is asserted; figures go to ``bench/results/overload.json`` (``bench.run``) or stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import fleet_load
from bench.common import HOST, cpu_seconds, machine, say, summary_ms, write_result
from bench.fleet import BLOB_BYTES, HANDSHAKES_PER_S, REGIONS
from bench.fleet_load import TP, Fleet, fleet_run
from workers.tools.procs import RegistryProcess

FLOOD_PATHS = ("/status", "/tp-groups?limit=500", "/events", "/metrics")
FLOOD_PROCS = 3
FLOOD_IN_FLIGHT = 64
# The readers run at the lowest CPU priority: on this 2-core machine they would otherwise take
# the registry's and the fleet client's CPU, which readers on other machines do not.
FLOOD_NICE = 19
PROBES = 4
BUDGET_S = 1.0  # a heartbeat's answer under overload, at most (its interval is 10 s)
SEATS_OFF = {"REGISTRY_SHED_IN_FLIGHT": "64", "REGISTRY_SHED_QUEUE_S": "0"}
BACK_MARGIN = 1.5  # "back to steady": CPU share within 1.5x the steady one (+ 2% of a core)


def flood(url: str, rate: float, seconds: float) -> dict[str, Any]:
    """Open-loop reads at ``rate`` a second for ``seconds``: answers by status and code."""
    counts: dict[str, int] = {}

    def add(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    async def one(client: httpx.AsyncClient, path: str) -> None:
        try:
            answer = await client.get(path)
        except httpx.HTTPError as exc:
            add(f"error {type(exc).__name__}")
            return
        if answer.status_code in (429, 503):
            code = answer.json().get("code") if answer.content else None
            add(f"{answer.status_code} {code} retry-after={answer.headers.get('retry-after')}")
        else:
            add(str(answer.status_code))

    async def main() -> None:
        limits = httpx.Limits(max_connections=FLOOD_IN_FLIGHT)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            tasks: set[asyncio.Task[None]] = set()
            start, n = time.perf_counter(), 0
            while (due := start + n / rate) < start + seconds:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if len(tasks) >= FLOOD_IN_FLIGHT:
                    add("not sent (in flight)")
                else:
                    task = asyncio.create_task(one(client, FLOOD_PATHS[n % len(FLOOD_PATHS)]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                n += 1
            if tasks:
                await asyncio.wait(tasks, timeout=60)

    asyncio.run(main())
    return counts


def _read_cost(url: str, pid: int) -> float:
    """The registry's CPU seconds for one read of each flood path, on average (quiet)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for path in FLOOD_PATHS:  # the first read of a path builds what later reads keep
            c.get(path)
        cpu0 = cpu_seconds(pid)
        for _ in range(2):
            for path in FLOOD_PATHS:
                c.get(path).raise_for_status()
        return (cpu_seconds(pid) - cpu0) / (2 * len(FLOOD_PATHS))


class Probes(threading.Thread):
    """``PROBES`` groups renewed every 0.25 s on their own connection: (time, seconds, status)."""

    def __init__(self, url: str, engines: list[tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        self.url, self.engines = url, engines
        self.seen: list[tuple[float, float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self.stop.wait(0.25):
                for gid, eid in self.engines:
                    body = {"engine_id": eid, "ranks": list(range(TP))}
                    t = time.perf_counter()
                    try:
                        status = c.post(f"/tp-groups/{gid}/engine/agents/heartbeat", json=body)
                        code = status.status_code
                    except httpx.HTTPError:
                        code = 0
                    self.seen.append((t, time.perf_counter() - t, code))


@contextlib.contextmanager
def _answers() -> Iterator[list[tuple[float, str, int]]]:
    """Every answer the fleet's client counts, with its send time (``Run.count``, wrapped)."""
    seen: list[tuple[float, str, int]] = []
    count = fleet_load.Run.count

    def counted(run: fleet_load.Run, kind: str, status: int, sent: float) -> None:
        seen.append((sent, kind, status))
        count(run, kind, status, sent)

    fleet_load.Run.count = counted  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        fleet_load.Run.count = count  # type: ignore[method-assign]


def _share(pid: int, seconds: float) -> float:
    cpu0 = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / seconds


def _surge(reg: RegistryProcess, fleet: Fleet, surge_s: float, times: float) -> dict[str, Any]:
    cost = _read_cost(reg.url, reg.pid)
    rate = times / cost  # reads a second that would take ``times`` cores
    probes = Probes(reg.url, list(fleet.engines.items())[:PROBES])
    probes.start()
    cpu0, t0 = cpu_seconds(reg.pid), time.perf_counter()
    cmd = [sys.executable, "-m", "bench.overload", "flood", reg.url]
    procs = [
        subprocess.Popen(
            [*cmd, str(rate / FLOOD_PROCS), str(surge_s)],
            stdout=subprocess.PIPE,
            preexec_fn=lambda: os.nice(FLOOD_NICE),
        )
        for _ in range(FLOOD_PROCS)
    ]
    counts: dict[str, int] = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=surge_s + 180)
        for key, n in json.loads(out).items():
            counts[key] = counts.get(key, 0) + n
    share = (cpu_seconds(reg.pid) - cpu0) / (time.perf_counter() - t0)
    probes.stop.set()
    probes.join(30)
    during = [(dt, code) for t, dt, code in probes.seen if t < t0 + surge_s]
    took = [dt for dt, _ in during]
    return {
        "read_cost_ms": round(cost * 1000, 1),
        "offered_reads_per_s": round(rate, 1),
        "offered_cores": times,
        "surge_s": surge_s,
        "server_core_share": round(share, 3),
        "reads": counts,
        "probe_heartbeat": summary_ms(took) | {"max_ms": round(max(took, default=0) * 1000, 1)},
        "probe_over_budget": sum(dt > BUDGET_S for dt in took),
        "probe_statuses": {str(c): sum(1 for _, x in during if x == c) for _, c in during},
        "budget_s": BUDGET_S,
    }


def _back(pid: int, steady: float) -> dict[str, Any]:
    shares, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < 60:
        shares.append(round(_share(pid, 5.0), 3))
        if shares[-1] <= steady * BACK_MARGIN + 0.02:
            break
    back = shares[-1] <= steady * BACK_MARGIN + 0.02
    return {"shares_5s": shares, "back_s": round(time.perf_counter() - t0, 1) if back else None}


def _restart(reg: RegistryProcess, fleet: Fleet, seen: list[tuple[float, str, int]]) -> Any:
    t_stop = time.perf_counter()
    reg.stop()
    reg.start(timeout_s=300)
    serving = time.perf_counter()
    time.sleep(fleet_load.HEARTBEAT_S + 5)  # every node's beat comes within its interval
    after = [(t, s) for t, kind, s in seen if kind == "heartbeat" and t >= t_stop]
    ok = sorted(t for t, s in after if s == 200 and t >= serving)
    nodes = len(fleet.engines)
    per_second: dict[int, int] = {}
    for t in ok:
        per_second[int(t - serving)] = per_second.get(int(t - serving), 0) + 1
    return {
        "down_s": round(serving - t_stop, 2),
        "heartbeats_404_after": sum(1 for _, s in after if s == 404),
        "refused_while_down": sum(1 for _, s in after if s == 0),
        "peak_answers_in_one_s": max(per_second.values(), default=0),
        "all_nodes_renewed_s": round(ok[nodes - 1] - serving, 2) if len(ok) >= nodes else None,
    }


def measure(
    ranks: int, surge_s: float, times: float, quick: bool, env: dict[str, str] | None = None
) -> dict[str, Any]:
    fleet = Fleet(ranks, BLOB_BYTES, REGIONS)
    warmup, window = (3.0, 5.0) if quick else (10.0, 30.0)
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as name:
        db = Path(name) / "overload.db"
        log = Path(name) / "reg.log"
        reg = RegistryProcess(f"sqlite:///{db}", host=HOST, env=env, log_path=log)
        reg.start(timeout_s=60)
        marks: list[float] = []
        phases: dict[str, Any] = {}
        try:
            with _answers() as seen:

                def after_window() -> dict[str, Any]:
                    steady = (marks[1] - marks[0]) / window
                    say(f"overload: steady {steady:.1%} of a core; surge of {surge_s} s")
                    phases["surge"] = _surge(reg, fleet, surge_s, times)
                    phases["back"] = _back(reg.pid, steady)
                    ended = time.perf_counter()
                    phases["heartbeats_404_through_back"] = sum(
                        1 for t, k, s in seen if k == "heartbeat" and s == 404 and t < ended
                    )
                    say("overload: restart")
                    phases["restart"] = _restart(reg, fleet, seen)
                    return {}

                out = asyncio.run(
                    fleet_run(
                        reg.url,
                        fleet,
                        warmup_s=warmup,
                        window_s=window,
                        handshakes_per_s=HANDSHAKES_PER_S,
                        on_window=lambda _: marks.append(cpu_seconds(reg.pid)),
                        after_window=after_window,
                    )
                )
        finally:
            reg.stop()
    hold = out["steady"]
    hold["server_core_share"] = round((marks[1] - marks[0]) / window, 3)
    work = (hold["heartbeats_per_s"] + hold["handshakes_per_s"]) * window
    hold["server_cpu_us_per_request"] = round((marks[1] - marks[0]) / max(1, work) * 1e6)
    return {
        "ranks": ranks,
        "store": "sqlite",
        "settings": env or "defaults",
        "launch": out["launch"],
        "steady": hold,
        **phases,
        "statuses_after_window": out["after_window_statuses"],
        "goals": {"ready_s": 10, "steady_core_share": 0.10, "lapses": 0, "back_s": 60},
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }


def run(quick: bool = False) -> dict[str, Any]:
    return measure(2000 if quick else 100_000, 10.0 if quick else 300.0, 3.0, quick)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["flood"]:
        url, rate, seconds = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
        print(json.dumps(flood(url, rate, seconds)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 ranks, a 10 s surge")
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--surge-s", type=float, default=None)
    parser.add_argument("--times", type=float, default=3.0, help="cores of reads offered")
    parser.add_argument(
        "--seats-baseline",
        action="store_true",
        help="first the same run with the seats off (REGISTRY_SHED_IN_FLIGHT=64, "
        "REGISTRY_SHED_QUEUE_S=0: shed past 64 reads at once, as before the seats), then with "
        "the defaults",
    )
    args = parser.parse_args(argv)
    ranks = args.ranks or (2000 if args.quick else 100_000)
    surge = args.surge_s or (10.0 if args.quick else 300.0)
    runs = [SEATS_OFF, None] if args.seats_baseline else [None]
    out = [measure(ranks, surge, args.times, args.quick, env) for env in runs]
    if args.seats_baseline:
        where = write_result("overload_seats", {"runs": out, "machine": machine()})
        say(f"overload: wrote {where}")
    print(json.dumps(out if len(out) > 1 else out[0], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
