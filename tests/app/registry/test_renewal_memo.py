"""A node's heartbeat on SQLite answered from its kept read while the store's memory is
unchanged (``Store.memory_version``, ``RenewalsMixin._leases_now``): no peek of its nine
entries; and the answers a fresh read gives whenever anything changed: a lease ended, the
node registered again, the group relaunched, the file reloaded. Real SQLite file, a
registry in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from app.core.errors import EngineIdMismatch, NotFound
from app.core.schemas import OpenEngineRequest, RegisterAgentsRequest
from app.registry import Registry
from app.store import Entry, Put
from app.store.sqlite.store import SqliteStore
from tests.support.faults import agent_body, open_body

pytestmark = [pytest.mark.store, pytest.mark.timeout(60)]

TP = 8
RANKS = list(range(TP))


class CountedPeeks(SqliteStore):
    """The SQLite store, counting its peeks (the heartbeat's read of its entries)."""

    peeks = 0

    def peek(self, keys: Sequence[str]) -> list[Entry | None] | None:
        self.peeks += 1
        return super().peek(keys)


async def launched(registry: Registry, gid: str) -> str:
    opened, _ = await registry.open_engine(
        gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
    )
    items = [{**agent_body(opened.engine_id, r), "rank": r} for r in RANKS]
    await registry.register_agents(
        gid, RegisterAgentsRequest.model_validate({"agents": items}), None
    )
    return opened.engine_id


@asynccontextmanager
async def one_node(tmp_path: Path) -> AsyncIterator[tuple[CountedPeeks, Registry, str]]:
    """A registry on a SQLite file, its group ``prefill-0`` launched: the store, the registry,
    the engine id."""
    store = CountedPeeks(tmp_path / "r.db")
    registry = Registry(store)
    await store.start()
    try:
        yield store, registry, await launched(registry, "prefill-0")
    finally:
        await store.close()


def test_heartbeats_at_an_unchanged_memory_peek_once(tmp_path: Path) -> None:
    """20 heartbeats of a node with nothing written between them: one peek (20 before), every
    one renewed; a write anywhere in the store makes the next one peek again."""

    async def main() -> None:
        async with one_node(tmp_path) as (store, registry, eid):
            before = store.peeks
            for _ in range(20):
                renewed = await registry.renew_agents("prefill-0", eid, RANKS)
                assert [r for r, _ in renewed] == RANKS
            assert store.peeks - before == 1
            await launched(registry, "prefill-1")  # another group: the memory changed
            before = store.peeks
            await registry.renew_agents("prefill-0", eid, RANKS)
            await registry.renew_agents("prefill-0", eid, RANKS)
            assert store.peeks - before == 1

    asyncio.run(main())


def test_writes_outside_the_groups_leave_the_kept_read_standing(tmp_path: Path) -> None:
    """The events a registry appends (a handshake's, a refusal's) are writes to the store, 20
    a second in a fleet: between two heartbeats of a node there is always one. They are not
    the group's entries: 20 heartbeats, an event written before each, peek once (20 before
    the version was kept per segment); a blob's write (``blobs/``) neither."""

    async def main() -> None:
        async with one_node(tmp_path) as (store, registry, eid):
            await registry.renew_agents("prefill-0", eid, RANKS)
            before = store.peeks
            for i in range(20):
                written = await store.txn([], [Put(f"events/{i:08d}", b"{}")])
                assert written.succeeded
                renewed = await registry.renew_agents("prefill-0", eid, RANKS)
                assert [r for r, _ in renewed] == RANKS
            await store.txn([], [Put("blobs/prefill-9/00000", b"x")])
            await registry.renew_agents("prefill-0", eid, RANKS)
            assert store.peeks == before
            await store.txn([], [Put("groups/prefill-9/engine", b"{}")])
            await registry.renew_agents("prefill-0", eid, RANKS)
            assert store.peeks == before + 1

    asyncio.run(main())


def test_a_kept_read_never_renews_what_a_fresh_read_refuses(tmp_path: Path) -> None:
    """The kept answer stands only while nothing changed: a lease that ended (not yet swept)
    is refused as absent, a relaunch's old engine as a mismatch, a node registered again is
    renewed on its new lease, and a reload of the file (a failed commit) reads afresh."""

    async def main() -> None:
        async with one_node(tmp_path) as (store, registry, eid):
            await registry.renew_agents("prefill-0", eid, RANKS)  # kept
            version = store.memory_version("groups")
            (lease,) = {e.lease for e in store._kv.values() if e.lease is not None}
            store._leases[lease].expires_at = 0.0  # ended, not yet swept: nothing written
            assert store.memory_version("groups") == version
            with pytest.raises(NotFound) as ended:
                await registry.renew_agents("prefill-0", eid, RANKS)
            assert ended.value.status == 404

            again = await launched(registry, "prefill-0")  # a relaunch: a new engine
            assert store.memory_version("groups") != version
            with pytest.raises(EngineIdMismatch):
                await registry.renew_agents("prefill-0", eid, RANKS)
            renewed = await registry.renew_agents("prefill-0", again, RANKS)
            assert [r for r, _ in renewed] == RANKS

            version = store.memory_version("groups")
            store._install(await store._thread.call(store._thread.file.load, 5.0))
            assert store.memory_version("groups") != version
            renewed = await registry.renew_agents("prefill-0", again, RANKS)
            assert [r for r, _ in renewed] == RANKS

    asyncio.run(main())
