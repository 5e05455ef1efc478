"""``python -m bench.keepalive [--nodes N] [--rate R] [--seconds S] [--rounds K]``: the
registry's CPU per node renewal over the REST batch heartbeat and over the keep-alive stream
(``GET /keepalive``), at the same renewal rate, in the same run.

One SQLite registry process (its default settings) on loopback; ``--nodes`` TP 8 groups opened
and registered (``bench/fleet_load.py``'s bodies). Then, for ``--rounds`` rounds, each mode for
``--seconds``, every node renewing its 8 ranks at ``--rate / --nodes`` a second, staggered:

- ``rest``: ``POST /tp-groups/{g}/engine/agents/heartbeat``, one kept-alive connection a node
  (``bench/raw_client.py``: prepared bytes, a few tens of µs of client Python);
- ``stream``: one WebSocket a node, one message ``[g, engine_id, ranks]`` a renewal;
- ``stream-422``: the same stream, a message the registry refuses before any lease work
  (``[]``): the stream's own share (frames, the read, a problem answer);
- ``floor``: the same messages over one WebSocket a node to ``bench.ws_floor``, a process on
  the registry's loop (uvloop) that only unmasks each frame and writes a fixed frame as long as
  the registry's renewal answer (measured first): "read a frame, write a frame" at one message
  a wakeup, the framework's own floor for this pace.

The server's CPU (user + system, all its threads, from ``/proc/<pid>/stat``: the registry's,
the floor process's for ``floor``) over each window, less its idle rate (measured first), per
renewal answered, its system share (the syscalls) beside it; the client's (this process's)
per renewal, and the ceiling it implies (renewals a second on one core). Rounds interleave
the modes; each mode's median and its ratio to ``rest``'s are of the same run. The defaults
are the 100,000-rank fleet's pace on a fiftieth of its nodes: 200 nodes renewing 1,250 times
a second (12,500 nodes every 10 s), about a minute in all. Nothing is asserted; the JSON
goes to ``bench/results/keepalive.json``.
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
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from bench.common import (
    HOST,
    free_port,
    machine,
    registry_server,
    say,
    summary_ms,
    write_result,
)
from bench.fleet import BLOB_BYTES, REGIONS
from bench.fleet_load import TP, Fleet
from bench.raw_client import RawPool
from bench.storm_core import COMPAT
from bench.ws_floor import floor_server

MODES = ("rest", "stream", "stream-422", "floor")
IDLE_S = 2.0
Renew = Callable[[int], Awaitable[bool]]  # node index -> whether the answer was a renewal


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


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
            agents = {"agents": fleet.agents(index, eid)}
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


async def idle_rates(pids: list[int]) -> list[float]:
    """Each process's CPU share of a core over ``IDLE_S`` of nothing asked."""
    before, wall0 = [cpu_seconds(p) for p in pids], time.monotonic()
    await asyncio.sleep(IDLE_S)
    wall = time.monotonic() - wall0
    return [(cpu_seconds(p) - b) / wall for p, b in zip(pids, before, strict=True)]


async def run(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(ranks=args.nodes * TP, blob_bytes=BLOB_BYTES, regions=REGIONS)
    port = int(url.rsplit(":", 1)[1])
    pool = RawPool(HOST, port, args.nodes)
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
    streams: list[ClientConnection] = [
        await connect(f"ws://{HOST}:{port}/keepalive", compression=None, proxy=None) for _ in groups
    ]
    await streams[0].send(messages[0])
    answer_bytes = len(await streams[0].recv(decode=False))  # the floor answers as long
    floor_port = free_port()
    with floor_server(floor_port, answer_bytes) as floor_pid:
        floors = [
            await connect(f"ws://{HOST}:{floor_port}/", compression=None, proxy=None)
            for _ in groups
        ]
        result = await rounds(pid, floor_pid, args, pool, bodies, messages, streams, floors)
        for ws in floors:
            await ws.close()
    for ws in streams:
        await ws.close()
    pool.close()
    return result | {"floor_answer_bytes": answer_bytes}


async def rounds(
    pid: int,
    floor_pid: int,
    args: argparse.Namespace,
    pool: RawPool,
    bodies: list[bytes],
    messages: list[str],
    streams: list[ClientConnection],
    floors: list[ClientConnection],
) -> dict[str, Any]:
    """``--rounds`` rounds of every mode, interleaved; the medians."""

    async def rest(i: int) -> bool:
        status, _ = await pool.send(bodies[i])
        return status == 200

    async def stream(i: int) -> bool:
        await streams[i].send(messages[i])
        return b'"agents"' in (await streams[i].recv(decode=False))

    async def refused(i: int) -> bool:
        await streams[i].send("[]")
        return b'"status":422' in (await streams[i].recv(decode=False))

    async def floor(i: int) -> bool:
        await floors[i].send(messages[i])
        return len(await floors[i].recv(decode=False)) > 0

    renewals: dict[str, Renew] = {
        "rest": rest,
        "stream": stream,
        "stream-422": refused,
        "floor": floor,
    }
    await asyncio.sleep(1.0)
    idle_rate, floor_idle = await idle_rates([pid, floor_pid])
    say(f"idle: registry {idle_rate * 100:.1f}%, floor {floor_idle * 100:.1f}% of a core")
    server = {m: (floor_pid, floor_idle) if m == "floor" else (pid, idle_rate) for m in MODES}
    seen: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for k in range(args.rounds):
        for mode in MODES:
            got = await measure(*server[mode], args.nodes, args.rate, args.seconds, renewals[mode])
            seen[mode].append(got)
            say(f"round {k + 1} {mode}: {got}")
    mid = {m: statistics.median(r["server_us"] for r in seen[m]) for m in MODES}
    return {
        "nodes": args.nodes,
        "rate": args.rate,
        "seconds": args.seconds,
        "idle_core_share": round(idle_rate, 4),
        "floor_idle_core_share": round(floor_idle, 4),
        "rounds": seen,
        "server_us_median": mid,
        "client_us_median": {m: statistics.median(r["client_us"] for r in seen[m]) for m in MODES},
        "ratio_to_rest": {m: round(mid[m] / mid["rest"], 3) for m in MODES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200, help="TP 8 nodes, one group each")
    parser.add_argument("--rate", type=float, default=1250.0, help="renewals a second, all nodes")
    parser.add_argument("--seconds", type=float, default=5.0, help="each mode's window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four modes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-keepalive-") as tmp:
        store = f"sqlite:///{Path(tmp) / 'registry.db'}"
        with registry_server(store, log=Path(tmp) / "registry.log") as url:
            result = asyncio.run(run(url, url.pid, args))
    result["machine"] = machine()
    path = write_result("keepalive", result)
    for mode in MODES:
        say(
            f"{mode:>10}: server {result['server_us_median'][mode]:6.1f} µs a renewal, "
            f"{result['ratio_to_rest'][mode]:.2f}x rest; client "
            f"{result['client_us_median'][mode]:6.1f} µs "
            f"(ceiling {1e6 / max(1.0, result['client_us_median'][mode]):,.0f}/s a core)"
        )
    say(f"wrote {path} (pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
