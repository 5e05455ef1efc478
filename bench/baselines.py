"""The storm's baselines: the same key operations done directly on etcd (aetcd), and the
ceilings (a bare ASGI app: the load client's own ceiling; a minimal FastAPI app) under the
registry's own server settings, loaded with aiohttp and with wrk."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import HOST, free_port, process, say, summary_ms, wait_http
from bench.storm_core import (
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

# -- etcd direct ---------------------------------------------------------------------------------


class EtcdStorm:
    def __init__(
        self, endpoint: str, ranks: int, prefix: str, blob_bytes: int | None = None
    ) -> None:
        self.host, port = endpoint.rsplit(":", 1)
        self.port = int(port)
        self.prefix = prefix
        self.groups = _groups(ranks)
        self.ranks = len(self.groups) * TP
        self.rec = Recorder()
        self.blobs = make_blobs(self.ranks, blob_bytes)
        self.opened: dict[str, asyncio.Future[str]] = {}
        self.complete: dict[str, asyncio.Event] = {}
        self.registered: dict[str, int] = defaultdict(int)
        self.ready_at: dict[str, float] = {}
        self.handshake_done: list[float] = []
        self.stop = asyncio.Event()
        self.heartbeats: list[asyncio.Task[None]] = []
        self.t0 = 0.0

    def _key(self, *parts: object) -> bytes:
        return "/".join([self.prefix, *map(str, parts)]).encode()

    async def _heartbeat(self, c: Any, lease: Any, phase: float) -> None:
        await every_heartbeat(
            self.stop, phase, lambda: self.rec.timed("heartbeat", lambda: c.refresh_lease(lease.id))
        )

    async def _rank(self, c: Any, index: int, gid: str, role: str, pair: int, rank: int) -> None:
        if rank == 0:
            eid = str(uuid.uuid4())
            await self.rec.timed("open", lambda: c.put(self._key(gid, "engine"), eid.encode()))
            self.opened[gid].set_result(eid)
        else:
            eid = await self.opened[gid]
            got = await self.rec.timed("get_engine", lambda: c.get(self._key(gid, "engine")))
            if got is None or got.value.decode() != eid:
                raise RuntimeError(f"etcd fetch {gid}/{rank}: {got}")
        lease = await self.rec.timed("lease_grant", lambda: c.lease(TTL_S))
        key = self._key(gid, "agents", rank)
        await self.rec.timed("register", lambda: c.put(key, self.blobs[index], lease=lease))
        self.registered[gid] += 1
        if self.registered[gid] == TP:
            self.ready_at[gid] = time.perf_counter() - self.t0
            self.complete[gid].set()
        phase = random.Random(index).uniform(0, HEARTBEAT_S)
        self.heartbeats.append(asyncio.create_task(self._heartbeat(c, lease, phase)))
        if role != "decode":
            return
        prefill = f"prefill-{pair}"
        await self.complete[prefill].wait()
        got = await self.rec.timed("handshake", lambda: c.get(self._key(prefill, "agents", rank)))
        if got is None:
            raise RuntimeError(f"etcd handshake {gid}/{rank}: no blob")
        self.handshake_done.append(time.perf_counter() - self.t0)

    async def run(self) -> dict[str, Any]:
        import aetcd

        loop = asyncio.get_running_loop()
        self.opened = {gid: loop.create_future() for gid, _, _ in self.groups}
        self.complete = {gid: asyncio.Event() for gid, _, _ in self.groups}
        async with aetcd.Client(host=self.host, port=self.port, timeout=60) as c:
            await c.get(self._key("warmup"))
            jobs = [
                (gid, role, pair, rank) for gid, role, pair in self.groups for rank in range(TP)
            ]
            random.Random(1).shuffle(jobs)
            self.t0 = time.perf_counter()
            tasks = [self._rank(c, i, *job) for i, job in enumerate(jobs)]
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), STORM_TIMEOUT_S)
            finally:
                done = time.perf_counter() - self.t0
                self.stop.set()
                await asyncio.gather(*self.heartbeats, return_exceptions=True)
        return storm_row(self, done) | {"target_ops_p99_ms": worst_p99_ms(self.rec)}


def etcd_storm(endpoint: str, ranks: int, blob_bytes: int | None = None) -> dict[str, Any]:
    prefix = f"/bench-{uuid.uuid4().hex[:8]}"
    return asyncio.run(EtcdStorm(endpoint, ranks, prefix, blob_bytes).run())


# -- ceilings ------------------------------------------------------------------------------------


async def _closed_loop(
    url: str, method: str, body: str | None, concurrency: int, seconds: float
) -> dict[str, Any]:
    latencies: list[float] = []
    headers = {"content-type": "application/json"} if body else None
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            for _ in range(10_000_000):
                if time.perf_counter() >= end:
                    return
                t = time.perf_counter()
                async with s.request(method, url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status >= 400:
                        raise RuntimeError(f"{method} {url}: {r.status}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"requests_per_s": round(len(latencies) / elapsed, 1), **summary_ms(latencies)}


def aiohttp_rate(
    url: str,
    method: str = "GET",
    body: str | None = None,
    concurrency: int = 64,
    seconds: float = 3,
) -> dict[str, Any]:
    return asyncio.run(_closed_loop(url, method, body, concurrency, seconds))


def wrk_rate(url: str, seconds: int, connections: int = 64, script: str | None = None) -> float:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"]
    if script:
        cmd += ["-s", script]
    out = subprocess.run(
        [*cmd, url], capture_output=True, text=True, timeout=seconds + 30, check=True
    ).stdout
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if found is None:
        raise RuntimeError(f"wrk printed no rate: {out}")
    return float(found.group(1))


def _register_body() -> str:
    # The storm's median blob (log-uniform 4-256 KiB: about 32 KiB).
    blobs = sorted(make_blobs(101), key=len)
    blob = base64.b64encode(blobs[50]).decode()
    return json.dumps(
        {
            "engine_id": "e",
            "agent_name": "a",
            "agent_metadata": blob,
            "host": HOST,
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [1],
                "num_blocks": 1,
                "block_len": 1,
            },
        }
    )


def ceilings(quick: bool) -> dict[str, Any]:
    seconds = 2 if quick else 5
    out: dict[str, Any] = {}
    body = _register_body()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "put.lua"
        script.write_text(
            'wrk.method = "PUT"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = {json.dumps(body)}\n"
        )
        for kind in ("raw", "fastapi"):
            port = free_port()
            cmd = [sys.executable, "-m", "bench.minimal", kind, str(port)]
            with process(cmd) as proc:
                base = f"http://{HOST}:{port}"
                wait_http(f"{base}/ping", 30.0, proc)
                say(f"  ceiling: {kind} server, GET, aiohttp and wrk")
                row: dict[str, Any] = {
                    "get_aiohttp": aiohttp_rate(f"{base}/ping", seconds=seconds),
                    "get_wrk_rps": wrk_rate(f"{base}/ping", seconds),
                }
                if kind == "fastapi":
                    say("  ceiling: fastapi server, PUT of an agent-sized body")
                    row["put_aiohttp"] = aiohttp_rate(
                        f"{base}/agents/1", "PUT", body, seconds=seconds
                    )
                    row["put_wrk_rps"] = wrk_rate(f"{base}/agents/1", seconds, script=str(script))
                out[kind] = row
    out["put_body_kib"] = round(len(body) / 1024, 1)
    return out
