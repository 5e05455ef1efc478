"""The request-path issue's launch storm, as it states it: G groups x TP 8, 4 KiB agents,
one client with at most 64 requests in flight.

Per group (17 requests): rank 0 opens the engine; the 7 others, told the engine_id in-process
(as the TP group's broadcast would), fetch and cross-verify it; the 8 ranks register their
agent (a 4 KiB metadata blob); once the group is complete (known in-process, nothing polled)
its rank 0 asks one handshake plan against the prefill engine of its pair (a prefill group
against itself). No heartbeats, no held requests: the heavier storm in ``bench.storm`` has
those. "Ready" is when the last group's last registration answered.

The same storm against:

- the registry (its default SQLite store);
- the framework's floor: a FastAPI app with the same four routes and the same request models
  (``app.core.schemas``) but no storage and no logic, on the registry's uvicorn settings
  (``python -m bench.minimal routes PORT``): what the storm costs before any registry work;
- etcd direct (aetcd, 64 calls in flight): put the engine key, get it, grant a lease and put
  the blob on it per agent, one range get of the group's agents per handshake;
- the registry's batched routes (``LeanBatched``): the group's leader, which has its ranks'
  metadata from the TP group's own collectives, opens, registers all 8 ranks in one request
  and asks one plan for every prefill rank: 3 requests per group.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import HOST, cpu_seconds
from bench.storm_core import COMPAT, ISSUE_BLOB, TP, TTL_S, Recorder, _groups, make_blobs, storm_row

IN_FLIGHT = 64
TIMEOUT_S = 300.0


class LeanStorm:
    """The storm's shape; ``call`` does one operation against the system under test."""

    def __init__(self, ranks: int) -> None:
        self.groups = _groups(ranks)
        self.ranks = len(self.groups) * TP
        self.blobs = make_blobs(self.ranks, ISSUE_BLOB)
        self.rec = Recorder()
        self.gate = asyncio.Semaphore(IN_FLIGHT)
        self.opened: dict[str, asyncio.Future[str]] = {}
        self.complete: dict[str, asyncio.Event] = {}
        self.registered: dict[str, int] = defaultdict(int)
        self.ready_at: dict[str, float] = {}
        self.handshake_done: list[float] = []
        self.t0 = 0.0

    async def timed(self, op: str, call: Callable[[], Awaitable[Any]]) -> Any:
        async with self.gate:
            return await self.rec.timed(op, call)

    # What each system does for one operation.
    async def open(self, gid: str, role: str) -> str:
        raise NotImplementedError

    async def fetch(self, gid: str) -> str:
        raise NotImplementedError

    async def register(self, gid: str, rank: int, eid: str, blob: bytes) -> None:
        raise NotImplementedError

    async def handshake(self, prefill_gid: str) -> None:
        raise NotImplementedError

    async def _rank(self, index: int, gid: str, role: str, pair: int, rank: int) -> None:
        if rank == 0:
            eid = await self.timed("open", lambda: self.open(gid, role))
            self.opened[gid].set_result(eid)
        else:
            eid = await self.opened[gid]
            got = await self.timed("get_engine", lambda: self.fetch(gid))
            if got != eid:
                raise RuntimeError(f"{gid}/{rank}: fetched engine {got}, opened {eid}")
        await self.timed("register", lambda: self.register(gid, rank, eid, self.blobs[index]))
        self.registered[gid] += 1
        if self.registered[gid] == TP:
            self.ready_at[gid] = time.perf_counter() - self.t0
            self.complete[gid].set()
        if rank != 0:
            return
        prefill = f"prefill-{pair}"
        await self.complete[prefill].wait()
        await self.timed("handshake", lambda: self.handshake(prefill))
        self.handshake_done.append(time.perf_counter() - self.t0)

    async def storm(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.opened = {gid: loop.create_future() for gid, _, _ in self.groups}
        self.complete = {gid: asyncio.Event() for gid, _, _ in self.groups}
        jobs = [(gid, role, pair, rank) for gid, role, pair in self.groups for rank in range(TP)]
        self.t0 = time.perf_counter()
        tasks = [self._rank(i, *job) for i, job in enumerate(jobs)]
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        done = time.perf_counter() - self.t0
        return storm_row(self, done) | {"in_flight": IN_FLIGHT, "blob_bytes": ISSUE_BLOB}


class HttpLean(LeanStorm):
    """The registry's routes over HTTP (aiohttp); also the framework-floor app's."""

    def __init__(self, url: str, ranks: int) -> None:
        super().__init__(ranks)
        self.url = url
        self.session: Any = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"content-type": "application/json"} if data is not None else None
        async with self.session.request(method, self.url + path, data=data, headers=headers) as r:
            raw = await r.read()
            if r.status >= 400:
                self.rec.errors[f"{method} {r.status}"] += 1
                raise RuntimeError(f"{method} {path}: {r.status} {raw[:200]!r}")
            return json.loads(raw) if raw else None

    async def open(self, gid: str, role: str) -> str:
        body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
        engine = await self._call("PUT", f"/tp-groups/{gid}/engine", body)
        return str(engine["engine_id"])

    async def fetch(self, gid: str) -> str:
        return str((await self._call("GET", f"/tp-groups/{gid}/engine"))["engine_id"])

    async def register(self, gid: str, rank: int, eid: str, blob: bytes) -> None:
        import base64

        body = {
            "engine_id": eid,
            "agent_name": f"{eid}-rank{rank}",
            "agent_metadata": base64.b64encode(blob).decode(),
            "host": HOST,
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [0x7F0000000000 + rank],
                "num_blocks": 1024,
                "block_len": 65536,
            },
            "ttl_s": TTL_S,
        }
        await self._call("PUT", f"/tp-groups/{gid}/engine/agents/{rank}", body)

    async def handshake(self, prefill_gid: str) -> None:
        eid = self.opened[prefill_gid].result()
        plan = await self._call(
            "POST", f"/engines/{eid}/handshake", {"tp_size": TP, "rank": 0, "compat": COMPAT}
        )
        if plan["targets"][0]["rank"] != 0:
            raise RuntimeError(f"bad plan against {prefill_gid}: {plan['targets']}")

    async def run(self) -> dict[str, Any]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as self.session:
            async with self.session.get(self.url + "/healthz") as r:  # warm one connection
                await r.read()
            pid = getattr(self.url, "pid", None)
            server_cpu = cpu_seconds(pid) if pid else 0.0
            client_cpu = time.process_time()
            row = await self.storm()
            row["client_cpu_s"] = round(time.process_time() - client_cpu, 3)
            if pid:
                row["server_cpu_s"] = round(cpu_seconds(pid) - server_cpu, 3)
        return row


class LeanBatched(HttpLean):
    """One leader per group: open, one batch registration, one handshake for every rank."""

    def _agent(self, eid: str, rank: int, blob: bytes) -> dict[str, Any]:
        import base64

        return {
            "rank": rank,
            "engine_id": eid,
            "agent_name": f"{eid}-rank{rank}",
            "agent_metadata": base64.b64encode(blob).decode(),
            "host": HOST,
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [0x7F0000000000 + rank],
                "num_blocks": 1024,
                "block_len": 65536,
            },
            "ttl_s": TTL_S,
        }

    async def _rank(self, index: int, gid: str, role: str, pair: int, rank: int) -> None:
        if rank != 0:
            return  # the leader does the group's requests
        eid = await self.timed("open", lambda: self.open(gid, role))
        self.opened[gid].set_result(eid)
        body = {"agents": [self._agent(eid, r, self.blobs[index + r]) for r in range(TP)]}
        path = f"/tp-groups/{gid}/engine/agents"
        await self.timed("register", lambda: self._call("PUT", path, body))
        self.ready_at[gid] = time.perf_counter() - self.t0
        self.complete[gid].set()
        prefill = f"prefill-{pair}"
        await self.complete[prefill].wait()
        await self.timed("handshake", lambda: self._plan_all(prefill))
        self.handshake_done.append(time.perf_counter() - self.t0)

    async def _plan_all(self, prefill_gid: str) -> None:
        eid = self.opened[prefill_gid].result()
        body = {"tp_size": 1, "rank": 0, "compat": COMPAT}
        plan = await self._call("POST", f"/engines/{eid}/handshake", body)
        if [t["rank"] for t in plan["targets"]] != list(range(TP)):
            raise RuntimeError(f"bad plan against {prefill_gid}: {plan['targets']}")


class EtcdLean(LeanStorm):
    """The same key operations straight on etcd (aetcd), nothing checked."""

    def __init__(self, endpoint: str, ranks: int) -> None:
        super().__init__(ranks)
        self.host, port = endpoint.rsplit(":", 1)
        self.port = int(port)
        self.prefix = f"/lean-{uuid.uuid4().hex[:8]}"
        self.c: Any = None

    def _key(self, *parts: object) -> bytes:
        return "/".join([self.prefix, *map(str, parts)]).encode()

    async def open(self, gid: str, role: str) -> str:
        eid = str(uuid.uuid4())
        await self.c.put(self._key(gid, "engine"), eid.encode())
        return eid

    async def fetch(self, gid: str) -> str:
        got = await self.c.get(self._key(gid, "engine"))
        return "" if got is None else str(got.value.decode())

    async def register(self, gid: str, rank: int, eid: str, blob: bytes) -> None:
        lease = await self.c.lease(TTL_S)
        await self.c.put(self._key(gid, "agents", rank), blob, lease=lease)

    async def handshake(self, prefill_gid: str) -> None:
        got = list(await self.c.get_prefix(self._key(prefill_gid, "agents", "")))
        if len(got) != TP:
            raise RuntimeError(f"etcd handshake {prefill_gid}: {len(got)} agents")

    async def run(self) -> dict[str, Any]:
        import aetcd

        async with aetcd.Client(host=self.host, port=self.port, timeout=60) as self.c:
            await self.c.get(self._key("warmup"))
            return await self.storm()


def lean_http(url: str, ranks: int) -> dict[str, Any]:
    return asyncio.run(HttpLean(url, ranks).run())


def lean_batched(url: str, ranks: int) -> dict[str, Any]:
    row = asyncio.run(LeanBatched(url, ranks).run())
    return row | {"requests_per_group": round(row["requests"] / row["groups"], 2)}


def lean_etcd(endpoint: str, ranks: int) -> dict[str, Any]:
    return asyncio.run(EtcdLean(endpoint, ranks).run())
