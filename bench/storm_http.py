"""The launch storm's client over real HTTP (`HttpStorm`): every rank of G groups x TP doing the
whole protocol at once, one coroutine each in one aiohttp process (`bench.storm` runs it, with
its baselines; `bench.storm_batched` batches it per node)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any

import aiohttp

from bench.common import (
    HOST,
    cpu_seconds,
)
from bench.storm_core import (
    COMPAT,
    HEARTBEAT_S,
    STORM_TIMEOUT_S,
    TP,
    TTL_S,
    Recorder,
    _groups,
    every_heartbeat,
    make_blobs,
    storm_row,
    worst_p99_ms,
)

# -- the registry over HTTP ----------------------------------------------------------------------


class HttpStorm:
    def __init__(
        self,
        url: str,
        ranks: int,
        connections: int,
        spread_s: float = 0.0,
        blob_bytes: int | None = None,
    ) -> None:
        self.url = url
        # 0: every rank starts at once (the storm); else groups launch evenly over spread_s.
        self.spread_s = spread_s
        self.groups = _groups(ranks)
        self.ranks = len(self.groups) * TP
        self.connections = connections
        self.rec = Recorder()
        self.blobs = [base64.b64encode(b).decode() for b in make_blobs(self.ranks, blob_bytes)]
        self.opened: dict[str, asyncio.Future[str]] = {}
        self.registered: dict[str, int] = defaultdict(int)
        self.ready_at: dict[str, float] = {}
        self.handshake_done: list[float] = []
        self.stop = asyncio.Event()
        self.heartbeats: list[asyncio.Task[None]] = []
        self.t0 = 0.0
        self.cpu: dict[str, float | None] = {}

    async def _call(
        self, s: aiohttp.ClientSession, op: str, method: str, path: str, body: Any = None
    ) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            data = None if body is None else json.dumps(body)
            headers = {"content-type": "application/json"} if data is not None else None
            async with s.request(method, self.url + path, data=data, headers=headers) as r:
                raw = await r.read()
                return r.status, (json.loads(raw) if raw else None)

        status, answer = await self.rec.timed(op, go)
        if status >= 400:
            self.rec.errors[f"{op} {status}"] += 1
        return status, answer

    async def _heartbeat(
        self,
        s: aiohttp.ClientSession,
        gid: str,
        rank: int,
        eid: str,
        agent: dict[str, Any],
        phase: float,
    ) -> None:
        async def beat() -> None:
            status, _ = await self._call(
                s,
                "heartbeat",
                "POST",
                f"/tp-groups/{gid}/engine/agents/{rank}/heartbeat",
                {"engine_id": eid},
            )
            if status == 404:  # the lease expired meanwhile: register again, as workers do
                await self._call(
                    s, "reregister", "PUT", f"/tp-groups/{gid}/engine/agents/{rank}", agent
                )

        await every_heartbeat(self.stop, phase, beat)

    async def _rank(
        self,
        s: aiohttp.ClientSession,
        w: aiohttp.ClientSession,
        index: int,
        gid: str,
        role: str,
        pair: int,
        rank: int,
    ) -> None:
        if self.spread_s:
            order = int(gid.split("-")[1]) * 2 + (role == "decode")
            await asyncio.sleep(order / len(self.groups) * self.spread_s)
        if rank == 0:
            body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
            status, engine = await self._call(s, "open", "PUT", f"/tp-groups/{gid}/engine", body)
            if status not in (200, 201):
                raise RuntimeError(f"open {gid}: {status} {engine}")
            self.opened[gid].set_result(engine["engine_id"])
            eid = engine["engine_id"]
        else:
            eid = await self.opened[gid]
            status, engine = await self._call(s, "get_engine", "GET", f"/tp-groups/{gid}/engine")
            if status != 200 or engine["engine_id"] != eid:
                raise RuntimeError(f"fetch {gid}/{rank}: {status} {engine}")
        agent = {
            "engine_id": eid,
            "agent_name": f"{eid}-rank{rank}",
            "agent_metadata": self.blobs[index],
            "host": HOST,
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [0x7F0000000000 + (index << 20)],
                "num_blocks": 1024,
                "block_len": 65536,
            },
            "ttl_s": TTL_S,
        }
        path = f"/tp-groups/{gid}/engine/agents/{rank}"
        status, answer = await self._call(s, "register", "PUT", path, agent)
        if status not in (200, 201):
            raise RuntimeError(f"register {gid}/{rank}: {status} {answer}")
        self.registered[gid] += 1
        if self.registered[gid] == TP:
            self.ready_at[gid] = time.perf_counter() - self.t0
        phase = random.Random(index).uniform(0, HEARTBEAT_S)
        self.heartbeats.append(
            asyncio.create_task(self._heartbeat(s, gid, rank, eid, agent, phase))
        )
        if role != "decode":
            return
        # Wait until the prefill group is ready, then ask for the plan; a 503 (a target's
        # lease lapsed meanwhile) sends the rank back to waiting, as a decode worker would.
        prefill = f"prefill-{pair}"
        body = {"tp_size": TP, "rank": rank, "compat": COMPAT}
        for _ in range(200):
            status, engine = await self._call(
                w, "wait_ready", "GET", f"/tp-groups/{prefill}/engine?wait_ready=30"
            )
            if status != 200 or not engine["ready"]:
                await asyncio.sleep(0.05)
                continue
            remote = engine["engine_id"]
            status, plan = await self._call(
                s, "handshake", "POST", f"/engines/{remote}/handshake", body
            )
            if status == 200:
                if plan["targets"][0]["rank"] != rank:
                    raise RuntimeError(f"bad plan for {gid}/{rank}: {plan['targets'][0]['rank']}")
                self.handshake_done.append(time.perf_counter() - self.t0)
                return
        raise RuntimeError(f"handshake {gid}/{rank} never answered 200")

    def _jobs(self, s: aiohttp.ClientSession, w: aiohttp.ClientSession) -> list[Awaitable[None]]:
        """One coroutine per rank, in a fixed random order."""
        jobs = [(gid, role, pair, rank) for gid, role, pair in self.groups for rank in range(TP)]
        random.Random(1).shuffle(jobs)
        return [self._rank(s, w, i, *job) for i, job in enumerate(jobs)]

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.opened = {gid: loop.create_future() for gid, _, _ in self.groups}
        # Held requests (wait_ready) get their own connections, as each real rank has its
        # own: sharing one bounded pool would starve the registrations they wait for.
        connector = aiohttp.TCPConnector(limit=self.connections)
        held = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as s,
            aiohttp.ClientSession(connector=held, timeout=timeout) as w,
        ):
            # Warm the connection pool's first connection and the server's first request.
            async with s.get(self.url + "/healthz") as r:
                await r.read()
            pid = getattr(self.url, "pid", None)
            server_cpu = cpu_seconds(pid) if pid else 0.0
            client_cpu = time.process_time()
            self.t0 = time.perf_counter()
            tasks = self._jobs(s, w)
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), STORM_TIMEOUT_S)
            finally:
                done = time.perf_counter() - self.t0
                self.stop.set()
                await asyncio.gather(*self.heartbeats, return_exceptions=True)
            self.cpu = {
                "client_cpu_s": round(time.process_time() - client_cpu, 3),
                "server_cpu_s": round(cpu_seconds(pid) - server_cpu, 3) if pid else None,
            }
        return self._report(done)

    def _report(self, done: float) -> dict[str, Any]:
        blob_mib = round(sum(len(b) for b in self.blobs) * 3 / 4 / 2**20, 1)
        return storm_row(self, done) | {
            "blob_mib": blob_mib,
            "target_ops_p99_ms": worst_p99_ms(self.rec),
            **self.cpu,
        }


def http_storm(
    url: str,
    ranks: int,
    connections: int = 1024,
    spread_s: float = 0.0,
    blob_bytes: int | None = None,
) -> dict[str, Any]:
    result = asyncio.run(HttpStorm(url, ranks, connections, spread_s, blob_bytes).run())
    return result | ({"spread_s": spread_s} if spread_s else {})
