"""Domain rules on a real SQLite file, below HTTP: what a relaunch does to the old agents."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.core.schemas import KvDescription, OpenEngineRequest, RegisterAgentRequest
from app.registry import Registry
from app.store.sqlite.store import SqliteStore

pytestmark = pytest.mark.unit

KV = KvDescription(mem_type="DRAM", device_id=0, base_addrs=[4096], num_blocks=4, block_len=64)


def test_a_relaunch_ends_the_superseded_agents_leases_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "registry.db")
        registry = Registry(store)
        try:
            first, _ = await registry.open_engine(
                "p0", OpenEngineRequest(launch_id="a", tp_size=1, role="prefill")
            )
            await registry.register_agent(
                "p0",
                0,
                RegisterAgentRequest(
                    engine_id=first.engine_id,
                    agent_name="n0",
                    agent_metadata="aGVsbG8=",
                    host="127.0.0.1",
                    kv=KV,
                    ttl_s=3600,
                ),
                "127.0.0.1",
            )
            agent = (await store.range("groups/p0/agents/")).entries[0]
            assert agent.lease is not None
            assert await store.refresh_lease(agent.lease) is not None

            await registry.open_engine(
                "p0", OpenEngineRequest(launch_id="b", tp_size=1, role="prefill")
            )
            # A heartbeat that read the old engine just before the relaunch cannot renew it.
            assert await store.refresh_lease(agent.lease) is None
            assert (await store.range("groups/p0/agents/")).entries == []
        finally:
            await store.close()

    asyncio.run(main())
