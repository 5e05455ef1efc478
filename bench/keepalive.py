"""``python -m bench.keepalive [--nodes N] [--rate R] [--seconds S] [--rounds K]``: the
registry's CPU per node renewal over the REST batch heartbeat and over the keep-alive stream
(``GET /keepalive``), at the same renewal rate, in the same run.

One SQLite registry process (its default settings) on loopback; ``--nodes`` TP 8 groups opened
and registered (``bench/fleet_load.py``'s bodies, on a lease of ``SETUP_TTL_S``: a large fleet's
set-up outlasts 30 s), and the registry let settle (under 5% of a core). Every node renews
once in each mode, unmeasured (a first renewal reads what later ones reuse). Then, for
``--rounds`` rounds, each mode for ``--seconds``, every node renewing its 8 ranks at
``--rate / --nodes`` a second, staggered:

- ``rest``: ``POST /tp-groups/{g}/engine/agents/heartbeat``, one kept-alive connection a node
  (``bench/raw_client.py``: prepared bytes, a few tens of µs of client Python);
- ``stream``: one WebSocket a node, one message ``[g, engine_id, ranks]`` a renewal;
- ``stream-422``: the same stream, a message the registry refuses before any lease work
  (``[]``): the stream's own share (frames, the read, a problem answer);
- ``floor``: the same messages over one WebSocket a node to ``bench.ws_floor``, a process on
  the registry's loop (uvloop) that only unmasks each frame and writes a fixed frame as long as
  the registry's renewal answer (measured first): "read a frame, write a frame" at one message
  a wakeup, the framework's own floor for this pace (its process and connections only when
  ``--modes`` names it).

The server's CPU (user + system, all its threads, from ``/proc/<pid>/stat``: the registry's,
the floor process's for ``floor``) over each window, less its idle rate (measured first), per
renewal answered, its system share (the syscalls) beside it; the client's (this process's)
per renewal, and the ceiling it implies (renewals a second on one core). Rounds interleave
the modes; each mode's median and its ratio to ``rest``'s are of the same run. The defaults
are the 100,000-rank fleet's pace on a fiftieth of its nodes: 200 nodes renewing 1,250 times
a second (12,500 nodes every 10 s), about a minute in all. Also the server's CPU a stream's
open (the upgrade), each registry's nodes opening theirs one at a time (``open_server_us``;
CPU ticks are 10 ms: 2,000 nodes or more). Nothing is asserted; the JSON goes to
``bench/results/keepalive.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from bench.common import (
    HOST,
    cpu_seconds,
    cpu_split,
    free_port,
    machine,
    registry_server,
    say,
    summary_ms,
    write_result,
)
from bench.fleet import BLOB_BYTES, REGIONS, stream_env
from bench.fleet_load import TP, Fleet
from bench.raw_client import RawPool
from bench.storm_core import COMPAT
from bench.ws_floor import floor_server
from workers.keepalive import OPTIONS
from workers.tools.procs import RegistryProcess

MODES = ("rest", "stream", "stream-422", "floor")
IDLE_S = 2.0
SETUP_TTL_S = 3600
Renew = Callable[[int], Awaitable[bool]]  # node index -> whether the answer was a renewal


async def launch(pool: RawPool, fleet: Fleet) -> None:
    """Open and register every group (one node each), a few at a time."""
    gate = asyncio.Semaphore(16)

    async def one(index: int, gid: str) -> None:
        async with gate:
            body = {
                "launch_id": uuid.uuid4().hex,
                "tp_size": TP,
                "role": "prefill",
                "compat": COMPAT,
            }
            status, answer = await pool.request("PUT", f"/tp-groups/{gid}/engine", body)
            if status not in (200, 201):
                raise RuntimeError(f"open {gid}: {status} {answer}")
            eid = answer["engine_id"]
            # A lease that outlives the set-up: at 12,500 nodes, launching and opening take
            # longer than the fleet's 30 s (what a renewal costs does not depend on it).
            agents = {"agents": [a | {"ttl_s": SETUP_TTL_S} for a in fleet.agents(index, eid)]}
            status, answer = await pool.request("PUT", f"/tp-groups/{gid}/engine/agents", agents)
            if status != 200:
                raise RuntimeError(f"register {gid}: {status} {answer}")
            fleet.engines[gid] = eid

    await asyncio.gather(*(one(i, g) for i, g in enumerate(fleet.groups)))


async def paced(nodes: int, rate: float, seconds: float, renew: Renew) -> dict[str, Any]:
    """Every node renews at ``rate / nodes`` a second for ``seconds``: counts, latencies."""
    period = nodes / rate
    latencies: list[float] = []
    failed = 0
    start = time.monotonic() + 0.2
    end = start + seconds

    async def node(index: int) -> None:
        nonlocal failed
        due = start + random.Random(index).uniform(0, period)
        while due < end:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = time.perf_counter()
            if await renew(index):
                latencies.append(time.perf_counter() - sent)
            else:
                failed += 1
            due += period

    await asyncio.gather(*(node(i) for i in range(nodes)))
    return {"answered": len(latencies), "failed": failed, "latency": summary_ms(latencies)}


async def measure(
    pid: int, idle_rate: float, nodes: int, rate: float, seconds: float, renew: Renew
) -> dict[str, Any]:
    (user0, sys0), client0, wall0 = cpu_split(pid), time.process_time(), time.monotonic()
    counts = await paced(nodes, rate, seconds, renew)
    wall = time.monotonic() - wall0
    user1, sys1 = cpu_split(pid)
    server = user1 - user0 + sys1 - sys0 - idle_rate * wall
    client = time.process_time() - client0
    n = max(1, counts["answered"] + counts["failed"])
    return counts | {
        "wall_s": round(wall, 2),
        "server_us": round(server / n * 1e6, 1),
        "server_system_us": round((sys1 - sys0) / n * 1e6, 1),
        "client_us": round(client / n * 1e6, 1),
    }


async def settle(pid: int, quiet: float = 0.05, limit_s: float = 60.0) -> None:
    """Wait until the registry's CPU over a second is under ``quiet`` of a core (a large
    fleet's set-up leaves a checkpoint and a collection behind), at most ``limit_s``."""
    deadline, rate = time.monotonic() + limit_s, 1.0
    while time.monotonic() < deadline:
        (rate,) = await idle_rates([pid], 1.0)
        if rate < quiet:
            return
    say(f"the registry still used {rate:.0%} of a core after {limit_s:g} s: measuring anyway")


async def idle_rates(pids: list[int], seconds: float = IDLE_S) -> list[float]:
    """Each process's CPU share of a core over ``seconds`` of nothing asked."""
    before, wall0 = [cpu_seconds(p) for p in pids], time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - wall0
    return [(cpu_seconds(p) - b) / wall for p, b in zip(pids, before, strict=True)]


@dataclass
class Target:
    """One registry under the fleet's load: its process, one pool and one stream a node."""

    pid: int
    pool: RawPool
    bodies: list[bytes]
    messages: list[str]
    streams: list[ClientConnection]
    open_us: float  # the server's CPU a stream's open (upgrade), the nodes' opened one at a time

    async def close(self) -> None:
        for ws in self.streams:
            await ws.close()
        self.pool.close()


async def target(url: str, pid: int, nodes: int) -> Target:
    """``nodes`` TP 8 groups opened and registered on ``url``, each node's requests prepared."""
    fleet = Fleet(ranks=nodes * TP, blob_bytes=BLOB_BYTES, regions=REGIONS)
    port = int(url.rsplit(":", 1)[1])
    pool = RawPool(HOST, port, nodes)
    await launch(pool, fleet)
    groups = fleet.groups
    bodies = [
        RawPool.prepare(
            "POST",
            f"/tp-groups/{gid}/engine/agents/heartbeat",
            {"engine_id": fleet.engines[gid], "ranks": list(range(TP))},
        )
        for gid in groups
    ]
    messages = [json.dumps([g, fleet.engines[g], list(range(TP))]) for g in groups]
    opened = cpu_seconds(pid)
    streams: list[ClientConnection] = [
        await connect(f"ws://{HOST}:{port}/keepalive", **OPTIONS) for _ in groups
    ]
    open_us = (cpu_seconds(pid) - opened) / len(groups) * 1e6
    return Target(pid, pool, bodies, messages, streams, open_us)


async def run(
    url: str, pid: int, before: tuple[str, int] | None, args: argparse.Namespace
) -> dict[str, Any]:
    now = await target(url, pid, args.nodes)
    old = await target(*before, args.nodes) if before is not None else None
    await now.streams[0].send(now.messages[0])
    answer_bytes = len(await now.streams[0].recv(decode=False))  # the floor answers as long
    floor_pid: int | None = None  # no floor process, no second connection a node, unless named
    floors: list[ClientConnection] = []
    with ExitStack() as stack:
        if "floor" in args.modes:
            floor_port = free_port()
            floor_pid = stack.enter_context(floor_server(floor_port, answer_bytes))
            floors = [await connect(f"ws://{HOST}:{floor_port}/", **OPTIONS) for _ in now.messages]
        result = await rounds(now, old, floor_pid, floors, args)
        for ws in floors:
            await ws.close()
    for t in (now, old):
        if t is not None:
            await t.close()
    opens = {"now": round(now.open_us)} | ({"before": round(old.open_us)} if old else {})
    return result | {"floor_answer_bytes": answer_bytes, "open_server_us": opens}


def renewals(t: Target) -> dict[str, Renew]:
    """The modes a registry serves: ``rest``, ``stream``, ``stream-422``."""

    async def rest(i: int) -> bool:
        status, _ = await t.pool.send(t.bodies[i])
        return status == 200

    async def stream(i: int) -> bool:
        await t.streams[i].send(t.messages[i])
        return b'"agents"' in (await t.streams[i].recv(decode=False))

    async def refused(i: int) -> bool:
        await t.streams[i].send("[]")
        return b'"status":422' in (await t.streams[i].recv(decode=False))

    return {"rest": rest, "stream": stream, "stream-422": refused}


async def rounds(
    now: Target,
    old: Target | None,
    floor_pid: int | None,
    floors: list[ClientConnection],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``--rounds`` rounds of every mode, interleaved; the medians."""

    async def floor(i: int) -> bool:
        await floors[i].send(now.messages[i])
        return len(await floors[i].recv(decode=False)) > 0

    modes: list[str] = list(args.modes)
    await settle(now.pid)
    pids = [t.pid for t in (now, old) if t is not None]
    if floor_pid is not None:
        pids.append(floor_pid)
    idle = dict(zip(pids, await idle_rates(pids), strict=True))
    say("idle: " + ", ".join(f"pid {p} {r * 100:.1f}%" for p, r in idle.items()) + " of a core")
    server: dict[str, tuple[int, Renew]] = {m: (now.pid, r) for m, r in renewals(now).items()}
    if floor_pid is not None:
        server["floor"] = (floor_pid, floor)
    if old is not None:  # the stream's modes on the registry of --before, interleaved
        modes += [f"{m}-before" for m in modes if m.startswith("stream")]
        server |= {f"{m}-before": (old.pid, r) for m, r in renewals(old).items()}
    # Every node renews once in each mode first, unmeasured: a node's first renewal reads and
    # keeps what its later ones reuse (at 8,000 nodes a 10 s window is 1.6 renewals a node).
    warm = args.nodes / args.rate
    for mode in modes:
        await paced(args.nodes, args.rate, warm, server[mode][1])
    seen: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for k in range(args.rounds):
        for mode in modes:
            pid, renew = server[mode]
            got = await measure(pid, idle[pid], args.nodes, args.rate, args.seconds, renew)
            seen[mode].append(got)
            say(f"round {k + 1} {mode}: {got}")
    mid = {m: statistics.median(r["server_us"] for r in seen[m]) for m in modes}
    base = mid.get("rest") or mid[modes[0]]
    return {
        "nodes": args.nodes,
        "rate": args.rate,
        "seconds": args.seconds,
        "modes": modes,
        "idle_core_share": round(idle[now.pid], 4),
        "floor_idle_core_share": round(idle[floor_pid], 4) if floor_pid is not None else None,
        "rounds": seen,
        "server_us_median": mid,
        "client_us_median": {m: statistics.median(r["client_us"] for r in seen[m]) for m in modes},
        "ratio_to_rest": {m: round(mid[m] / base, 3) for m in modes},
        "ratio_to_floor": {m: round(mid[m] / mid["floor"], 2) for m in modes if "floor" in mid},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200, help="TP 8 nodes, one group each")
    parser.add_argument("--rate", type=float, default=1250.0, help="renewals a second, all nodes")
    parser.add_argument("--seconds", type=float, default=5.0, help="each mode's window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the modes")
    parser.add_argument(
        "--modes",
        type=lambda text: [m for m in text.split(",") if m],
        default=list(MODES),
        help=f"comma-separated, of {','.join(MODES)} (a profile's load: one mode)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of other code (git archive COMMIT app | tar -x -C DIR): its registry "
        "too, the stream's modes, interleaved (MODE-before)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        parser.error(f"--modes: {unknown or 'none'} not of {','.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="bench-keepalive-") as tmp, ExitStack() as stack:
        store = f"sqlite:///{Path(tmp) / 'registry.db'}"
        sized = stream_env(args.nodes)  # past 4,096 nodes the defaults refuse streams 503
        url = stack.enter_context(registry_server(store, log=Path(tmp) / "registry.log", env=sized))
        before = None
        if args.before is not None:
            old = RegistryProcess(
                f"sqlite:///{Path(tmp) / 'before.db'}",
                host=HOST,
                log_path=Path(tmp) / "before.log",
                env=sized,
                cwd=args.before.resolve(),
            ).start(timeout_s=30.0)
            stack.callback(old.stop)
            before = (old.url, old.pid)
        result = asyncio.run(run(url, url.pid, before, args))
    result["machine"] = machine()
    result["before"] = str(args.before) if args.before else None
    path = write_result("keepalive", result)
    for mode in result["modes"]:
        say(
            f"{mode:>10}: server {result['server_us_median'][mode]:6.1f} µs a renewal, "
            f"{result['ratio_to_rest'][mode]:.2f}x rest, "
            f"{result['ratio_to_floor'].get(mode, 0):.1f}x floor; client "
            f"{result['client_us_median'][mode]:6.1f} µs "
            f"(ceiling {1e6 / max(1.0, result['client_us_median'][mode]):,.0f}/s a core)"
        )
    say(f"a stream's open: server {result['open_server_us']} µs (CPU ticks: --nodes 2000 or more)")
    say(f"wrote {path} (pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
