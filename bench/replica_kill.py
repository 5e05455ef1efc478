"""``python -m bench.replica_kill [--quick] [--ranks N]``: a fleet on two registry replicas of a
3-member etcd, one replica killed (SIGKILL) under it (issue 43; ``docs/operations.md``,
"Overload").

1. **Store and replicas**: a 3-member etcd (``harness.etcd.EtcdCluster``, the quota and
   compaction of ``bench/fleet.py``), two ``engine-registry serve`` processes A and B on it,
   each on its own port.
2. **The fleet** (``bench/fleet_load.py``: TP 8 groups, one leader a node, a heartbeat every
   10 s under a 30 s lease, 20 handshakes a second in the window) spread as a load balancer
   would: pairs of nodes alternate between the replica lists [A, B] and [B, A], each talks to
   its first, and on a refused or broken connection moves as ``registry_client``'s transport
   does (``fleet_load.Route``: the next replica at once, full-jitter back-off only once every
   replica failed, then it stays on the replica that answered).
3. **Launch and steady state**: the time until every rank is registered, then each replica's
   CPU share and the heartbeat p50/p99 in a window (30 s; ``--quick``: 5 s).
4. **The kill**: ``kill -9`` of A while the heartbeats go on. From the kill on, for A's nodes
   (the moved ones): the refused tries on A, each second's answers 200 from B (the largest:
   the reconnect peak), the time until every moved node has renewed on B, B's CPU share until
   then; for every node: heartbeats answered 404 (a lapsed lease: the goal is 0), calls no
   replica answered. Then one more heartbeat interval: B's CPU share serving the whole fleet,
   and the two replicas' steady share over it (``two_over_one``; issue 51's goal: ≤ 1.2).
5. **A again**: A started on the same port and store: the time until it serves, and the tries
   it gets in the next interval (nodes stay where they renewed: none move back).

With ``--stop S`` a stall comes first (issue 51): ``kill -STOP`` of A for S seconds, then
``kill -CONT``; A's nodes wait for it (the fleet's client has no call deadline under the
heartbeat's interval). Two heartbeat intervals on, the heartbeats answered 404 (a live rank
lapsed by the stall: the goal is 0) and the slowest answer; then the kill as above.

Nothing is asserted; figures go to ``bench/results/replica_kill.json`` (``bench.run``) or
stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import HOST, cpu_seconds, etcd_store_available, say
from bench.fleet import BLOB_BYTES, HANDSHAKES_PER_S, REGIONS, _etcd
from bench.fleet_load import HEARTBEAT_S, TTL_S, Fleet, Run, first_replica, fleet_run
from workers.tools.procs import RegistryProcess

A, B = 0, 1  # the replicas' indices in the fleet's URL list
POLL_S = 0.5


def _kill(a: RegistryProcess, b: RegistryProcess, moved: set[int], run: Run) -> dict[str, Any]:
    """SIGKILL A; until every moved node renewed on B (at most two leases' ttl), then one
    heartbeat interval on B alone; then A again."""
    if a.proc is None:
        raise RuntimeError("replica A is not running: start it before the kill")
    cpu_b0, t_kill = cpu_seconds(b.pid), time.perf_counter()
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(30)
    seen, first_on_b = 0, dict[int, float]()  # moved node -> its first 200 from B, when
    deadline = t_kill + 2 * TTL_S
    while len(first_on_b) < len(moved) and time.perf_counter() < deadline:
        time.sleep(POLL_S)
        tries = run.tries[seen:]
        seen += len(tries)
        for sent, done, group, replica, status in tries:
            if sent >= t_kill and replica == B and status == 200 and group in moved:
                first_on_b.setdefault(group, done)
    t_all, cpu_b1 = time.perf_counter(), cpu_seconds(b.pid)
    time.sleep(HEARTBEAT_S)
    alone = (cpu_seconds(b.pid) - cpu_b1) / HEARTBEAT_S
    t_restart = time.perf_counter()
    a.start(timeout_s=300)
    serving = time.perf_counter()
    time.sleep(HEARTBEAT_S)
    after = [t for t in run.tries if t[0] >= t_kill]
    per_second: dict[int, int] = {}
    for _, done, group, replica, status in after:
        if replica == B and status == 200 and group in moved:
            per_second[int(done - t_kill)] = per_second.get(int(done - t_kill), 0) + 1
    last = max(first_on_b.values(), default=t_kill)
    complete = len(first_on_b) == len(moved)
    return {
        "how": "SIGKILL of replica A (kill -9)",
        "moved_nodes": len(moved),
        "moved_nodes_renewed_on_b": len(first_on_b),
        "all_moved_renewed_s": round(last - t_kill, 2) if complete else None,
        "peak_moved_answers_in_one_s": max(per_second.values(), default=0),
        "moved_answers_per_s_first_12s": [per_second.get(s, 0) for s in range(12)],
        "refused_tries_on_a": sum(1 for t in after if t[3] == A and t[4] == 0 and t[0] < serving),
        "tries_503_429": sum(1 for t in after if t[4] in (429, 503)),
        "heartbeats_404_after": sum(1 for t in after if t[4] == 404),
        "calls_no_replica_answered": run.after.get("heartbeat 0", 0),
        "b_core_share_until_all_moved": round((cpu_b1 - cpu_b0) / max(1e-9, t_all - t_kill), 3),
        "b_core_share_whole_fleet": round(alone, 3),
        "a_restart_serving_s": round(serving - t_restart, 2),
        "tries_on_a_after_restart": sum(1 for t in after if t[3] == A and t[0] >= serving),
    }


def _stop(a: RegistryProcess, run: Run, seconds: float) -> dict[str, Any]:
    """SIGSTOP A for ``seconds``, SIGCONT, then two heartbeat intervals: every node renewed
    at least once after A came back, so a lease A ended wrongly shows as a 404."""
    t_stop = time.perf_counter()
    os.kill(a.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    time.sleep(2 * HEARTBEAT_S)
    after = [t for t in run.tries if t[0] >= t_stop]
    waits = sorted(done - sent for sent, done, _, _, _ in after)
    return {
        "how": f"SIGSTOP of replica A for {seconds:g} s, then SIGCONT",
        "heartbeat_tries": len(after),
        "heartbeats_404_after": sum(1 for t in after if t[4] == 404),
        "tries_503_429": sum(1 for t in after if t[4] in (429, 503)),
        "tries_refused_or_broken": sum(1 for t in after if t[4] == 0),
        "answers_waited_over_1s": sum(1 for w in waits if w > 1.0),
        "slowest_answer_s": round(waits[-1], 2) if waits else None,
    }


def measure(ranks: int, quick: bool, stop_s: float = 0.0) -> dict[str, Any]:
    ok, why = etcd_store_available()
    if not ok:
        return {"ranks": ranks, "skipped": why}
    fleet = Fleet(ranks, BLOB_BYTES, REGIONS)
    warmup, window = (3.0, 5.0) if quick else (10.0, 30.0)
    run = Run()
    moved = {i for i in range(len(fleet.groups)) if first_replica(i, 2) == A}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="bench-replica-kill-") as name:
        tmp = Path(name)
        with _etcd(tmp) as cluster:
            store = cluster.url("kill")
            a = RegistryProcess(store, host=HOST, log_path=tmp / "a.log")
            b = RegistryProcess(store, host=HOST, log_path=tmp / "b.log")
            marks: list[tuple[float, float]] = []
            phases: dict[str, Any] = {}

            def after_window() -> dict[str, Any]:
                if stop_s > 0:
                    say(f"replica_kill: {ranks} ranks; SIGSTOP of replica A for {stop_s:g} s")
                    phases["stop"] = _stop(a, run, stop_s)
                say(f"replica_kill: {ranks} ranks; SIGKILL of replica A")
                phases["kill"] = _kill(a, b, moved, run)
                return {}

            try:
                a.start(timeout_s=60)
                b.start(timeout_s=60)
                out = asyncio.run(
                    fleet_run(
                        [a.url, b.url],
                        fleet,
                        warmup_s=warmup,
                        window_s=window,
                        handshakes_per_s=HANDSHAKES_PER_S,
                        on_window=lambda _: marks.append((cpu_seconds(a.pid), cpu_seconds(b.pid))),
                        after_window=after_window,
                        run=run,
                    )
                )
            finally:
                a.stop()
                b.stop()
    hold = out["steady"]
    hold["core_share_a_b"] = [round((marks[1][k] - marks[0][k]) / window, 3) for k in (A, B)]
    alone = phases["kill"]["b_core_share_whole_fleet"]  # after_window always ran by now
    if alone > 0:  # the two replicas' CPU against one's (B) serving the same fleet alone
        hold["two_over_one"] = round(sum(hold["core_share_a_b"]) / alone, 2)
    return {
        "ranks": ranks,
        "groups": len(fleet.groups),
        "store": "etcd, 3 members",
        "replicas": 2,
        "launch": out["launch"],
        "steady": hold,
        **phases,
        "statuses_after_window": out["after_window_statuses"],
        "goals": {"lapses": 0, "two_over_one": 1.2},
        "registry_env": {
            k: v for k, v in os.environ.items() if k.startswith("REGISTRY_ETCD_RENEW")
        },
        "load_before": load_before,
        "load_after": Path("/proc/loadavg").read_text().split()[:3],
    }


def run(quick: bool = False) -> dict[str, Any]:
    return measure(2000 if quick else 100_000, quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_kill", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 ranks, a 5 s window")
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument(
        "--stop", type=float, default=0.0, help="SIGSTOP replica A this long before the kill"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.stop < HEARTBEAT_S:
        parser.error(f"--stop {args.stop:g}: 0 (none) up to the {HEARTBEAT_S:g} s interval")
    ranks = args.ranks or (2000 if args.quick else 100_000)
    print(json.dumps(measure(ranks, args.quick, args.stop), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
