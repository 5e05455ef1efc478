"""Writers decide on changes still on their way to the SQLite file; refusals wait for them.

The file's thread is held by a job queued in front of the commits (a real SQLite file, a
real thread): every change made meanwhile stays pending until the test lets it go."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from app.core.errors import EngineIdMismatch
from app.core.schemas import Agent, KvDescription, OpenEngineRequest, RegisterAgentRequest
from app.registry import Registry
from app.store.sqlite.store import SqliteStore

pytestmark = pytest.mark.unit

KV = KvDescription(mem_type="DRAM", device_id=0, base_addrs=[4096], num_blocks=4, block_len=64)


def _agent(engine_id: str, rank: int) -> RegisterAgentRequest:
    return RegisterAgentRequest(
        engine_id=engine_id,
        agent_name=f"n{rank}",
        agent_metadata="aGVsbG8=",
        host="127.0.0.1",
        kv=KV,
        ttl_s=3600,
    )


@asynccontextmanager
async def _held(store: SqliteStore) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Holds the file's thread; yields ``release``."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(store._thread.call(lambda: gate.wait(30.0), 60.0))

    async def release() -> None:
        gate.set()
        await blocker

    try:
        yield release
    finally:
        gate.set()
        await asyncio.wait_for(blocker, 60.0)


async def _ticks(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@asynccontextmanager
async def _opened(tmp_path: Path, tp_size: int) -> AsyncIterator[tuple[SqliteStore, Registry, str]]:
    """A registry on a real SQLite file with group p0 open: (store, registry, engine_id)."""
    store = SqliteStore(tmp_path / "registry.db")
    registry = Registry(store)
    try:
        engine, _ = await registry.open_engine(
            "p0", OpenEngineRequest(launch_id="a", tp_size=tp_size, role="prefill")
        )
        yield store, registry, engine.engine_id
    finally:
        await store.close()


def test_a_registration_does_not_wait_for_its_groups_pending_changes(tmp_path: Path) -> None:
    async def main() -> None:
        async with _opened(tmp_path, 2) as (store, registry, engine_id):
            async with _held(store) as release:
                first = asyncio.ensure_future(
                    registry.register_agent("p0", 1, _agent(engine_id, 1), None)
                )
                await _ticks()
                assert store.stats()["pending"] == 1
                second = asyncio.ensure_future(
                    registry.register_agent("p0", 0, _agent(engine_id, 0), None)
                )
                await _ticks()
                # Decided on rank 1's pending change, not waiting for it: both are pending.
                assert store.stats()["pending"] == 2
                assert not first.done()
                assert not second.done()
                await release()
                answers: list[tuple[Agent, bool]] = await asyncio.wait_for(
                    asyncio.gather(first, second), 30.0
                )
            assert [(a.rank, created) for a, created in answers] == [(1, True), (0, True)]
            state = await registry.get_engine("p0")
            assert state.ready
            assert state.registered_ranks == [0, 1]

    asyncio.run(main())


def test_a_refusal_waits_for_the_pending_change_it_would_name(tmp_path: Path) -> None:
    async def main() -> None:
        async with _opened(tmp_path, 1) as (store, registry, old_engine_id):
            async with _held(store) as release:
                relaunch = asyncio.ensure_future(
                    registry.open_engine(
                        "p0", OpenEngineRequest(launch_id="b", tp_size=1, role="prefill")
                    )
                )
                await _ticks()
                # A rank of the old launch: refused, but only once the relaunch is durable
                # (a crash before it lands would make the refusal name an engine that never was).
                stale = asyncio.ensure_future(
                    registry.register_agent("p0", 0, _agent(old_engine_id, 0), None)
                )
                await _ticks()
                assert not stale.done()
                await release()
                new, created = await asyncio.wait_for(relaunch, 30.0)
                assert created
                with pytest.raises(EngineIdMismatch) as refused:
                    await asyncio.wait_for(stale, 30.0)
            assert refused.value.extras["expected_engine_id"] == new.engine_id

    asyncio.run(main())
