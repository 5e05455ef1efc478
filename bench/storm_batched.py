"""The launch storm with the batched routes: a group's leader does what its ranks did.

Per group, as a worker library using batches would (the TP group's own collectives carry
the engine_id and each rank's metadata to and from the leader, in-process here):

1. rank 0 opens the engine (``PUT /tp-groups/{g}/engine``);
2. the leader registers all its ranks in one request (``PUT /tp-groups/{g}/engine/agents``,
   one transaction, one shared lease) and renews them with one heartbeat every
   ``HEARTBEAT_S`` (``POST …/agents/heartbeat``);
3. a decode group's leader waits for its prefill group (``GET …/engine?wait_ready=30``) and
   asks once for every prefill rank (``POST /engines/{id}/handshake`` with ``tp_size: 1``),
   which its ranks then slice by vLLM's convention.

So 2 requests per prefill group and 4 per decode group, against 17 and more per group with
one request per rank. The ranks' blobs, TTL and heartbeat interval are the same as in
``bench.storm``.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import aiohttp

from bench.common import HOST
from bench.storm_core import COMPAT, HEARTBEAT_S, TP, TTL_S, every_heartbeat
from bench.storm_http import HttpStorm


class BatchedStorm(HttpStorm):
    def _jobs(self, s: aiohttp.ClientSession, w: aiohttp.ClientSession) -> list[Awaitable[None]]:
        jobs = list(enumerate(self.groups))
        random.Random(1).shuffle(jobs)
        return [self._group(s, w, i, *group) for i, group in jobs]

    async def _renew(self, s: aiohttp.ClientSession, gid: str, eid: str, phase: float) -> None:
        body = {"engine_id": eid, "ranks": list(range(TP))}
        path = f"/tp-groups/{gid}/engine/agents/heartbeat"
        await every_heartbeat(
            self.stop, phase, lambda: self._call(s, "heartbeat", "POST", path, body)
        )

    async def _group(
        self,
        s: aiohttp.ClientSession,
        w: aiohttp.ClientSession,
        index: int,
        gid: str,
        role: str,
        pair: int,
    ) -> None:
        body: dict[str, Any] = {
            "launch_id": uuid.uuid4().hex,
            "tp_size": TP,
            "role": role,
            "compat": COMPAT,
        }
        status, engine = await self._call(s, "open", "PUT", f"/tp-groups/{gid}/engine", body)
        if status not in (200, 201):
            raise RuntimeError(f"open {gid}: {status} {engine}")
        eid = engine["engine_id"]
        agents = [
            {
                "rank": rank,
                "engine_id": eid,
                "agent_name": f"{eid}-rank{rank}",
                "agent_metadata": self.blobs[index * TP + rank],
                "host": HOST,
                "kv": {
                    "mem_type": "DRAM",
                    "device_id": 0,
                    "base_addrs": [0x7F0000000000 + ((index * TP + rank) << 20)],
                    "num_blocks": 1024,
                    "block_len": 65536,
                },
                "ttl_s": TTL_S,
            }
            for rank in range(TP)
        ]
        path = f"/tp-groups/{gid}/engine/agents"
        status, answer = await self._call(s, "register", "PUT", path, {"agents": agents})
        if status != 200:
            raise RuntimeError(f"register {gid}: {status} {answer}")
        self.registered[gid] = TP
        self.ready_at[gid] = time.perf_counter() - self.t0
        phase = random.Random(index).uniform(0, HEARTBEAT_S)
        self.heartbeats.append(asyncio.create_task(self._renew(s, gid, eid, phase)))
        if role != "decode":
            return
        prefill = f"prefill-{pair}"
        plan_body = {"tp_size": 1, "rank": 0, "compat": COMPAT}
        for _ in range(200):
            status, remote = await self._call(
                w, "wait_ready", "GET", f"/tp-groups/{prefill}/engine?wait_ready=30"
            )
            if status != 200 or not remote["ready"]:
                await asyncio.sleep(0.05)
                continue
            status, plan = await self._call(
                s, "handshake", "POST", f"/engines/{remote['engine_id']}/handshake", plan_body
            )
            if status == 200:
                if [t["rank"] for t in plan["targets"]] != list(range(TP)):
                    raise RuntimeError(f"bad plan for {gid}: {plan['targets']}")
                self.handshake_done.append(time.perf_counter() - self.t0)
                return
        raise RuntimeError(f"handshake {gid} never answered 200")


def batched_storm(
    url: str, ranks: int, connections: int = 1024, blob_bytes: int | None = None
) -> dict[str, Any]:
    result = asyncio.run(BatchedStorm(url, ranks, connections, blob_bytes=blob_bytes).run())
    result["requests_per_group"] = round(result["requests"] / result["groups"], 2)
    return result | {"batched": True}
