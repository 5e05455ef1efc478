"""``python -m bench.route_cost [--groups N] [--rounds R] [--per-round K] [--launch L]
[--base DIR]``: the registry's CPU a request, for each route and message the fast path serves,
with it on and off (``REGISTRY_FAST_PATH``), interleaved in one run: a route's fast path is
kept only where it saves at least 20% (issue #50). ``--base DIR``: instead, this checkout
against another one (``git worktree add --detach DIR <commit>``), both with the fast path, run
from their own directories: each row's ``ratio`` is this checkout's CPU over the base's.

Two registry processes (``python -m app serve``, SQLite), one with the fast path, one without,
each given the same fleet of N TP 8 groups (``bench.fleet_load``'s bodies: 3,928-byte blobs
of 80 regions, a lease of 600 s). Then R rounds; in each, every route runs on both servers in
turn (which goes first alternates): K requests one at a time on one kept-alive connection
(``bench.raw_client``), the server process's CPU over them (``/proc``, all its threads) over
K, and the requests a second. The fleet's steady state: the node's heartbeat, a rank's
heartbeat, the lookup, the handshake, a node's renewal over a keep-alive stream (one message
answered before the next). The launch: L fresh groups a round opened, then their node's
batch registered, then L more opened and one rank registered each. Medians of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from bench.common import cpu_seconds, machine, say
from bench.fleet import BLOB_BYTES, REGIONS
from bench.fleet_load import TP, Fleet
from bench.raw_client import RawPool
from bench.storm_core import COMPAT
from harness.server import ROOT, RegistryProcess

TTL_S = 600
MODES = ("on", "asgi", "off")
AB_MODES = ("on", "base")
# "asgi": the fast path's ASGI layer alone (app/server/bypass/fastpath.py, a plain ASGI app in
# front of FastAPI), without its layers on uvicorn's internals (hot.py, wire.py,
# keepalive_wire.py): the process's serve() is told they are unavailable.
ASGI_ONLY = "import app.server.serve as serve\nserve.wanted = lambda fast_path: False\n"
Samples = dict[str, list[tuple[float, float]]]  # "route|mode": (CPU µs a request, requests/s)


@contextlib.contextmanager
def servers(where: Path, base: Path | None = None) -> Iterator[dict[str, RegistryProcess]]:
    with contextlib.ExitStack() as stack:
        procs = {}
        for mode in MODES if base is None else AB_MODES:
            env = {"REGISTRY_FAST_PATH": "false" if mode == "off" else "true"}
            env["REGISTRY_LOG_LEVEL"] = "warning"
            cwd = base if mode == "base" else ROOT
            if base is not None:  # each checkout's own packages, not the installed ones
                env["PYTHONPATH"] = str(cwd)
            if mode == "asgi":
                site = where / "asgi-site"
                site.mkdir()
                (site / "sitecustomize.py").write_text(ASGI_ONLY)
                env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
            store = f"sqlite:///{where / f'{mode}.db'}"
            procs[mode] = stack.enter_context(
                RegistryProcess(store, env=env, log_path=where / f"{mode}.log", cwd=cwd)
            )
        yield procs


class Target:
    """One server: its pool, its fleet's engines, and the launch's groups."""

    def __init__(self, proc: RegistryProcess, mode: str) -> None:
        self.proc = proc
        self.mode = mode
        self.last = (0.0, 0.0, 1)  # the last timed block: CPU s, wall s, requests
        self.pool = RawPool("127.0.0.1", proc.port, 1)
        self.engines: dict[str, str] = {}
        self.opened: list[tuple[str, str]] = []

    async def call(self, request: bytes, want: tuple[int, ...] = (200,)) -> bytes:
        status, body = await self.pool.send(request)
        if status not in want:
            raise RuntimeError(f"{status}: {body[:300]!r}")
        return body


def open_body() -> dict[str, Any]:
    return {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": "prefill", "compat": COMPAT}


def agents(fleet: Fleet, index: int, eid: str) -> dict[str, Any]:
    return {"agents": [a | {"ttl_s": TTL_S} for a in fleet.agents(index, eid)]}


async def load(target: Target, fleet: Fleet) -> None:
    for i, gid in enumerate(fleet.groups):
        body = open_body() | {"role": "prefill" if gid.startswith("prefill") else "decode"}
        opened = await target.call(RawPool.prepare("PUT", f"/tp-groups/{gid}/engine", body), (201,))
        eid = json.loads(opened)["engine_id"]
        await target.call(
            RawPool.prepare("PUT", f"/tp-groups/{gid}/engine/agents", agents(fleet, i, eid))
        )
        target.engines[gid] = eid


def steady_requests(t: Target, kind: str, picks: list[str]) -> list[bytes]:
    out = []
    for i, gid in enumerate(picks):
        eid = t.engines[gid]
        if kind == "node heartbeat":
            body: Any = {"engine_id": eid, "ranks": list(range(TP))}
            out.append(RawPool.prepare("POST", f"/tp-groups/{gid}/engine/agents/heartbeat", body))
        elif kind == "rank heartbeat":
            path = f"/tp-groups/{gid}/engine/agents/{i % TP}/heartbeat"
            out.append(RawPool.prepare("POST", path, {"engine_id": eid}))
        elif kind == "lookup":
            out.append(RawPool.prepare("GET", f"/tp-groups/{gid}/engine"))
        else:  # a decode rank's handshake with a prefill engine (the fleet's even groups)
            n = int(gid.rpartition("-")[2])
            eid = t.engines[f"prefill-{n - n % 2:06d}"]
            body = {"tp_size": TP, "rank": i % TP}
            out.append(RawPool.prepare("POST", f"/engines/{eid}/handshake", body))
    return out


async def timed(t: Target, requests: list[bytes], want: tuple[int, ...]) -> list[bytes]:
    """Send each, one at a time; note the server's CPU and the wall time of the block."""
    cpu, wall = cpu_seconds(t.proc.pid), time.perf_counter()
    answers = [await t.call(r, want) for r in requests]
    t.last = (cpu_seconds(t.proc.pid) - cpu, time.perf_counter() - wall, len(requests))
    return answers


async def renewals(t: Target, picks: list[str]) -> None:
    url = t.proc.url.replace("http://", "ws://") + "/keepalive"
    messages = [json.dumps([g, t.engines[g], list(range(TP))]) for g in picks]
    async with connect(url, compression=None, proxy=None) as ws:
        await ws.send(messages[0])
        await ws.recv()
        cpu, wall = cpu_seconds(t.proc.pid), time.perf_counter()
        for m in messages:
            await ws.send(m)
            answer = await ws.recv()
            if '"agents"' not in str(answer):
                raise RuntimeError(f"renewal refused: {str(answer)[:300]}")
        t.last = (cpu_seconds(t.proc.pid) - cpu, time.perf_counter() - wall, len(messages))


async def launch(
    t: Target, fleet: Fleet, n: int, into: dict[str, list[tuple[float, float]]]
) -> None:
    """n groups opened, then their node's registrations; n more opened, a rank's each."""
    names = [f"launch-{uuid.uuid4().hex[:12]}" for _ in range(2 * n)]
    opens = [RawPool.prepare("PUT", f"/tp-groups/{g}/engine", open_body()) for g in names]
    bodies = [agents(fleet, i, "") for i in range(n)]
    answers = await timed(t, opens[:n], (201,))
    note(t, into, "open (launch)")
    regs = []
    for g, answer, body in zip(names[:n], answers, bodies, strict=True):
        eid = json.loads(answer)["engine_id"]
        for a in body["agents"]:
            a["engine_id"], a["agent_name"] = eid, f"{eid}-rank{a['rank']}"
        regs.append(RawPool.prepare("PUT", f"/tp-groups/{g}/engine/agents", body))
    await timed(t, regs, (200,))
    note(t, into, "node registration (launch)")
    answers = [await t.call(r, (201,)) for r in opens[n:]]
    singles = []
    for g, answer, body in zip(names[n:], answers, bodies, strict=True):
        eid = json.loads(answer)["engine_id"]
        one = {k: v for k, v in body["agents"][0].items() if k != "rank"}
        one["engine_id"], one["agent_name"] = eid, f"{eid}-rank0"
        singles.append(RawPool.prepare("PUT", f"/tp-groups/{g}/engine/agents/0", one))
    await timed(t, singles, (201,))
    note(t, into, "rank registration (launch)")


def note(t: Target, into: Samples, kind: str) -> None:
    cpu, wall, n = t.last
    into.setdefault(f"{kind}|{t.mode}", []).append((cpu / n * 1e6, n / wall))


STEADY = ("node heartbeat", "rank heartbeat", "lookup", "handshake")


async def measure(
    where: Path, groups: int, rounds: int, per_round: int, n_launch: int, base: Path | None
) -> dict[str, Any]:
    fleet = Fleet(groups * TP, BLOB_BYTES, REGIONS)
    samples: dict[str, list[tuple[float, float]]] = {}
    with servers(where, base) as procs:
        targets = [Target(procs[m], m) for m in procs]
        for t in targets:
            say(f"loading {groups} groups into the fast path {t.mode} server")
            await load(t, fleet)
        rng = random.Random(1)
        for r in range(rounds):
            turn = r % len(targets)
            order = targets[turn:] + targets[:turn]  # each mode first in turn
            picks = [rng.choice(fleet.groups) for _ in range(per_round)]
            for kind in STEADY:
                for t in order:
                    requests = steady_requests(t, kind, picks)
                    await timed(t, requests[:50], (200,))  # the connection and caches warm
                    await timed(t, requests, (200,))
                    note(t, samples, f"{kind} (steady)")
            for t in order:
                await renewals(t, picks)
                note(t, samples, "keep-alive renewal (steady)")
            for t in order:
                await launch(t, fleet, n_launch, samples)
            say(f"round {r + 1}/{rounds} done")
        for t in targets:
            t.pool.close()
    return table(samples)


def table(samples: Samples) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for key, values in samples.items():
        kind, mode = key.split("|")
        cpu = sorted(v[0] for v in values)[len(values) // 2]
        rate = sorted(v[1] for v in values)[len(values) // 2]
        rows.setdefault(kind, {})[mode] = {"cpu_us": round(cpu, 1), "per_s": round(rate)}
    for row in rows.values():
        if "base" in row:
            row["ratio"] = round(row["on"]["cpu_us"] / row["base"]["cpu_us"], 3)
            continue
        row["saving"] = round(1 - row["on"]["cpu_us"] / row["off"]["cpu_us"], 3)
        row["asgi_saving"] = round(1 - row["asgi"]["cpu_us"] / row["off"]["cpu_us"], 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=2000)
    parser.add_argument("--launch", type=int, default=200)
    parser.add_argument("--base", type=Path, help="another checkout to compare this one with")
    args = parser.parse_args(argv)
    if args.base is not None and not (args.base / "app" / "__main__.py").is_file():
        parser.error(f"--base {args.base}: no app/__main__.py there; name a checkout's root")
    with tempfile.TemporaryDirectory(prefix="route-cost-") as tmp:
        rows = asyncio.run(
            measure(Path(tmp), args.groups, args.rounds, args.per_round, args.launch, args.base)
        )
    print(json.dumps({"routes": rows, "machine": machine(), "args": vars(args)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
