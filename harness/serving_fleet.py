"""A fleet of serving instances published through a real registry's API, cheaply: each group
TP 1, its one rank registered under a long lease, and where it serves published (no server
behind the URL: routers fed by router-sync only learn the addresses). Half prefill, half
decode, all of one model and compat, so router-sync offers every one of them.

Used by the router-sync tests and ``python -m bench.router_round``."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import httpx

COMPAT = {"model": "tiny", "block_size": 16, "dtype": "bfloat16"}


def one_rank_agent(engine_id: str, name: str, ttl_s: int) -> dict[str, Any]:
    """The registration body of a TP 1 group's rank 0: a tiny DRAM KV layout on loopback."""
    kv = {"mem_type": "DRAM", "device_id": 0, "base_addrs": [4096], "num_blocks": 8}
    return {
        "engine_id": engine_id,
        "agent_name": name,
        "host": "127.0.0.1",
        "agent_metadata": base64.b64encode(b"md").decode(),
        "ttl_s": ttl_s,
        "kv": kv | {"block_len": 64},
    }


def address(i: int) -> str:
    """A distinct http host:port for instance ``i`` (loopback addresses, nothing listening)."""
    return f"127.{1 + i // 62500}.{(i // 250) % 250}.{1 + i % 250}:8000"


async def _one(http: httpx.AsyncClient, i: int, ttl_s: int) -> None:
    gid = f"fleet-{i:06d}"
    role = "decode" if i % 2 else "prefill"
    body = {"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": role, "compat": COMPAT}
    opened = await http.put(f"/tp-groups/{gid}/engine", json=body)
    opened.raise_for_status()
    engine_id = opened.json()["engine_id"]
    agent = one_rank_agent(engine_id, f"{gid}-0", ttl_s)
    (await http.put(f"/tp-groups/{gid}/engine/agents/0", json=agent)).raise_for_status()
    serving = {"engine_id": engine_id, "url": f"http://{address(i)}", "model": "tiny"}
    (await http.put(f"/tp-groups/{gid}/engine/serving", json=serving)).raise_for_status()


async def _publish(url: str, count: int, token: str | None, ttl_s: int, concurrency: int) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=60.0, limits=limits, trust_env=False
    ) as http:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                await _one(http, queue.get_nowait(), ttl_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def publish(
    url: str, count: int, *, token: str | None = None, ttl_s: int = 3600, concurrency: int = 32
) -> float:
    """Publish ``count`` ready serving groups; the seconds it took."""
    started = time.monotonic()
    asyncio.run(_publish(url, count, token, ttl_s, concurrency))
    return time.monotonic() - started


__all__ = ["COMPAT", "address", "publish"]
