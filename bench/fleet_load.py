"""The fleet's load, as the worker library makes it (``bench/fleet.py`` runs it).

One aiohttp client process plays every node's leader (``workers.publication.BatchPublication``:
a TP 8 group on one node, so one leader, one lease and one heartbeat stream per group):

- **launch**: each group opens its engine (``PUT /tp-groups/{g}/engine``) and registers its
  eight ranks in one request (``PUT …/engine/agents``, one shared lease of ``TTL_S``), 64
  groups in flight; the fleet is ready when the last group's registration is answered;
- **steady state**: each group renews its lease every ``TTL_S / 3`` seconds (the library's
  default pace) with ``POST …/agents/heartbeat``, at a phase of its own; beside them, decode
  leaders plan against random prefill engines (``POST /engines/{id}/handshake``, the
  leader's plan for all eight prefill ranks) at ``handshakes_per_s``.

Latencies are from the client's send to its answer, so they include the client's own
scheduling delay: ``lag`` (how late each heartbeat was sent against its schedule) is reported
beside them, and ``bench/fleet.py`` runs the same pace against a server that does no work.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import summary_ms
from bench.storm_core import COMPAT

TP = 8
TTL_S = 30  # the library's default lease
HEARTBEAT_S = TTL_S / 3  # LeaseKeeper's default fraction
IN_FLIGHT = 64
PLANNERS = 4


@dataclass
class Fleet:
    """The groups of a fleet of ``ranks`` (TP 8: half prefill, half decode)."""

    ranks: int
    blob_bytes: int
    regions: int
    engines: dict[str, str] = field(default_factory=dict)  # group id -> engine id

    @property
    def groups(self) -> list[str]:
        n = self.ranks // TP
        return [f"{'prefill' if i % 2 == 0 else 'decode'}-{i:06d}" for i in range(n)]

    def agents(self, index: int, eid: str) -> list[dict[str, Any]]:
        blob = base64.b64encode(os.urandom(self.blob_bytes)).decode()
        base = 0x7F0000000000 + (index << 32)
        return [
            {
                "rank": rank,
                "engine_id": eid,
                "agent_name": f"{eid}-rank{rank}",
                "agent_metadata": blob,
                "host": f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}",
                "kv": {
                    "mem_type": "VRAM",
                    "device_id": rank,
                    # one region per layer, as vLLM registers a 70B model's KV cache
                    "base_addrs": [base + (rank << 28) + (r << 20) for r in range(self.regions)],
                    "num_blocks": 86_000,
                    "block_len": 65_536,
                },
                "ttl_s": TTL_S,
            }
            for rank in range(TP)
        ]


def _session(limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=120)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


async def launch(url: str, fleet: Fleet) -> dict[str, Any]:
    """Open and register every group; the fleet's ready time and the requests' latencies."""
    gate = asyncio.Semaphore(IN_FLIGHT)
    opens: list[float] = []
    registers: list[float] = []
    errors: list[str] = []

    async def group(s: aiohttp.ClientSession, index: int, gid: str) -> None:
        role = "prefill" if gid.startswith("prefill") else "decode"
        body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
        async with gate:
            t = time.perf_counter()
            async with s.put(f"{url}/tp-groups/{gid}/engine", json=body) as r:
                answer = await r.json()
                opens.append(time.perf_counter() - t)
                if r.status not in (200, 201):
                    errors.append(f"open {gid}: {r.status}")
                    return
            eid = answer["engine_id"]
            agents = {"agents": fleet.agents(index, eid)}
            t = time.perf_counter()
            async with s.put(f"{url}/tp-groups/{gid}/engine/agents", json=agents) as r:
                await r.read()
                registers.append(time.perf_counter() - t)
                if r.status != 200:
                    errors.append(f"register {gid}: {r.status}")
                    return
            fleet.engines[gid] = eid

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    async with _session(IN_FLIGHT) as s:
        await asyncio.gather(*(group(s, i, g) for i, g in enumerate(fleet.groups)))
    ready = time.perf_counter() - t0
    return {
        "ready_s": round(ready, 2),
        "ranks_per_s": round(fleet.ranks / ready),
        "open": summary_ms(opens),
        "register": summary_ms(registers),
        "errors": len(errors),
        "first_errors": errors[:5],
        "client_cpu_s": round(time.process_time() - cpu0, 2),
    }


async def steady(
    url: str, fleet: Fleet, warmup_s: float, window_s: float, handshakes_per_s: float,
    on_window: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Heartbeats at the library's pace and decode planning for ``warmup_s + window_s``;
    latencies of the window only. ``on_window(start: bool)`` marks the window's ends (the
    caller samples the server's CPU there)."""
    beats: list[float] = []
    lags: list[float] = []
    plans: list[float] = []
    statuses: dict[str, int] = {}
    t0 = time.perf_counter()
    start, end = t0 + warmup_s, t0 + warmup_s + window_s
    prefill = [eid for gid, eid in fleet.engines.items() if gid.startswith("prefill")]

    def count(kind: str, status: int) -> None:
        key = f"{kind} {status}"
        statuses[key] = statuses.get(key, 0) + 1

    async def node(s: aiohttp.ClientSession, gid: str, eid: str, phase: float) -> None:
        body = {"engine_id": eid, "ranks": list(range(TP))}
        due = t0 + phase
        while due < end:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent = time.perf_counter()
            async with s.post(f"{url}/tp-groups/{gid}/engine/agents/heartbeat", json=body) as r:
                await r.read()
            done = time.perf_counter()
            if start <= sent < end:
                beats.append(done - sent)
                lags.append(sent - due)
                count("heartbeat", r.status)
            due += HEARTBEAT_S

    async def planner(s: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        body = {"tp_size": 1, "rank": 0, "compat": COMPAT}
        due = t0
        while due < end and prefill and handshakes_per_s > 0:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            eid = rng.choice(prefill)
            sent = time.perf_counter()
            async with s.post(f"{url}/engines/{eid}/handshake", json=body) as r:
                await r.read()
            if start <= sent < end:
                plans.append(time.perf_counter() - sent)
                count("handshake", r.status)
            due += PLANNERS / handshakes_per_s

    async def marks() -> None:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        if on_window:
            on_window(True)
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        if on_window:
            on_window(False)

    rng = random.Random(3)
    cpu0 = time.process_time()
    async with _session(0) as s:
        tasks = [node(s, g, e, rng.uniform(0, HEARTBEAT_S)) for g, e in fleet.engines.items()]
        planners = [planner(s, k) for k in range(PLANNERS)]
        await asyncio.gather(*tasks, *planners, marks())
    return {
        "window_s": window_s,
        "heartbeat": summary_ms(beats),
        "heartbeats_per_s": round(len(beats) / window_s, 1),
        "client_lag": summary_ms(lags),
        "handshake": summary_ms(plans),
        "handshakes_per_s": round(len(plans) / window_s, 1),
        "statuses": statuses,
        "client_cpu_share": round((time.process_time() - cpu0) / (warmup_s + window_s), 3),
    }
