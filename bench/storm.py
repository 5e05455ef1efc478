"""Launch storm: G groups x TP ranks doing the whole protocol at once over real HTTP.

Half the groups are prefill, half decode (TP 8 each, decode group i pairs with prefill group
i). Every rank is one coroutine of one aiohttp client process (the server runs in its own):

1. rank 0 opens the engine (``PUT /tp-groups/{g}/engine``); the other ranks wait for its
   broadcast (an in-process event, as torch.distributed would carry it), then fetch and
   cross-verify the engine (``GET /tp-groups/{g}/engine``);
2. every rank registers its agent (``PUT …/agents/{rank}``) with a metadata blob of 4 KiB to
   256 KiB (log-uniform, fixed seed) and starts heartbeating (every ``HEARTBEAT_S``, a third
   of its ``TTL_S``, the first at a random phase);
3. every decode rank resolves its prefill group (``GET …/engine?wait_ready=30``, held until
   ready) and asks for its handshake plan (``POST /engines/{id}/handshake``).

The storm is over when every handshake has answered 200. "Ranks/s to ready" counts every
rank over the time until the last group became ready (its last registration answered).
Since every rank arrives at once, a request's latency is mostly its wait in the queue; a
paced row (1,024 ranks, groups launching evenly over ``PACED_S``) shows per-operation latency
when the offered load stays below what the service sustains.

Baselines in the same run:

- **etcd direct** (aetcd, a gRPC client, the one the etcd store uses): rank 0 puts the engine
  key, the others get it; every rank grants a lease and puts its blob on it; heartbeats renew
  the lease; every decode rank gets its target blob once the prefill group is complete, the
  readiness signalled in-process for free (what NIXL's etcd metadata exchange does: put per
  agent, get per handshake, nothing checked);
- **ceilings**: a bare ASGI app (the aiohttp client's own ceiling) and a minimal FastAPI app,
  both under the registry's uvicorn settings, loaded with aiohttp and with wrk.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.baselines import ceilings, etcd_storm
from bench.common import (
    HOST,
    cpu_seconds,
    registry_server,
    say,
)
from bench.storm_core import (
    BLOB_MAX,
    BLOB_MIN,
    COMPAT,
    HEARTBEAT_S,
    PACED_S,
    STORM_TIMEOUT_S,
    TARGET_OPS,
    TP,
    TTL_S,
    Recorder,
    _groups,
    blob_sizes,
    every_heartbeat,
    make_blobs,
    storm_row,
    worst_p99_ms,
)

__all__ = [
    "BLOB_MAX",
    "BLOB_MIN",
    "COMPAT",
    "HEARTBEAT_S",
    "PACED_S",
    "STORM_TIMEOUT_S",
    "TARGET_OPS",
    "TP",
    "TTL_S",
    "HttpStorm",
    "Recorder",
    "blob_sizes",
    "http_storm",
    "make_blobs",
    "run",
]


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


# -- the whole question --------------------------------------------------------------------------


def _etcd_rows(sizes: list[int], results: dict[str, Any], tmp: Path, note: list[str]) -> None:
    from bench.common import etcd_store_available
    from tests.support.etcd import EtcdCluster, etcd_available

    if not etcd_available():
        note.append("etcd rows skipped: no etcd binary")
        return
    with EtcdCluster(tmp / "etcd", size=1) as cluster:
        endpoint = cluster.endpoints[0]
        for n in sizes:
            say(f"  etcd direct (aetcd), {n} ranks")
            results["etcd_direct"][str(n)] = _guarded(partial(etcd_storm, endpoint, n))
        ok, why = etcd_store_available()
        if not ok:
            note.append(f"registry-on-etcd rows skipped: {why}")
            return
        for n in sizes:
            say(f"  registry on etcd, {n} ranks")
            url = cluster.url(f"bench-{uuid.uuid4().hex[:8]}")
            with registry_server(url, log=tmp / f"registry-etcd-{n}.log") as http:
                results["registry_etcd"][str(n)] = _guarded(partial(http_storm, http, n))


def _guarded(storm: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one storm; a failure (timeout, refused connections) becomes a row saying so."""
    try:
        row = storm()
    except Exception as exc:  # recorded and reported; the other rows still run
        row = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        say(f"    FAILED: {row['failed']}")
        return row
    _show(row)
    return row


def _show(row: dict[str, Any]) -> None:
    cpu = f", server CPU {row['server_cpu_s']} s" if row.get("server_cpu_s") else ""
    say(
        f"    ready in {row['ready_s']} s ({row['ranks_per_s']} ranks/s), "
        f"{row['requests_per_s']} req/s, worst per-op p99 {row['target_ops_p99_ms']} ms{cpu}, "
        f"errors {row['errors'] or 'none'}"
    )


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [256] if quick else [256, 1024, 4096]
    results: dict[str, Any] = {
        "sizes": sizes,
        "tp": TP,
        "heartbeat_s": HEARTBEAT_S,
        "paced_s": PACED_S,
        "registry_sqlite": {},
        "registry_sqlite_paced": {},
        "registry_sqlite_batched": {},
        "registry_etcd": {},
        "etcd_direct": {},
        "notes": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as name:
        tmp = Path(name)
        for n in sizes:
            say(f"  registry on SQLite, {n} ranks")
            store = f"sqlite:///{tmp}/storm-{n}.db"
            with registry_server(store, log=tmp / f"registry-sqlite-{n}.log") as url:
                results["registry_sqlite"][str(n)] = _guarded(partial(http_storm, url, n))
        # The batched routes: a group's leader registers and renews all its ranks at once.
        from bench.storm_batched import batched_storm

        for n in sizes[-2:] if not quick else sizes:
            say(f"  registry on SQLite, {n} ranks, batched routes")
            store = f"sqlite:///{tmp}/batched-{n}.db"
            with registry_server(store, log=tmp / f"registry-batched-{n}.log") as url:
                results["registry_sqlite_batched"][str(n)] = _guarded(
                    partial(batched_storm, url, n)
                )
        # The same load arriving over PACED_S instead of at once: latency without the queue.
        if not quick:
            say(f"  registry on SQLite, 1024 ranks launching evenly over {PACED_S:g} s")
            with registry_server(f"sqlite:///{tmp}/paced.db", log=tmp / "paced.log") as url:
                results["registry_sqlite_paced"]["1024"] = _guarded(
                    lambda: http_storm(url, 1024, spread_s=PACED_S)
                )
        _etcd_rows(sizes, results, tmp, results["notes"])
    results["ceilings"] = ceilings(quick)
    return results
