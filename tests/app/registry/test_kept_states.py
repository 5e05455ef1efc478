"""Every group's state for an operator's read (the status page, /metrics) is kept per version
of the group (``app/registry/kept_states.py``) and the observer passes over a group that did
not change (``app/registry/observer.py``). Both must answer what a fresh read and a full comparison
would: a real SQLite file, the registry's real watch feed, real leases."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from app.core.schemas import OpenEngineRequest, RegisterAgentsRequest, ServingRequest
from app.registry import Registry
from app.registry.events import EventLog
from app.registry.records import Decoded
from app.registry.state import GroupState
from app.store import Snapshot, create_store
from app.watch.feed import Feed
from harness.feeds import registry_with_feed
from tests.support.faults import agent_body, open_body

pytestmark = pytest.mark.store

TP = 4


async def _open(registry: Registry, gid: str) -> str:
    opened, _ = await registry.open_engine(
        gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
    )
    return opened.engine_id


async def _register(registry: Registry, gid: str, eid: str, ranks: range, ttl_s: int = 30) -> None:
    body = {"agents": [{**agent_body(eid, r, ttl_s), "rank": r} for r in ranks]}
    await registry.register_agents(gid, RegisterAgentsRequest.model_validate(body), None)


def _fields(state: GroupState) -> dict[str, Any]:
    return {
        "engine": state.engine,
        "engine_revision": state.engine_revision,
        "agents": state.agents,
        "agent_revisions": state.agent_revisions,
        "expires_at": state.expires_at,
        "revision": state.revision,
        "serving": state.serving,
        "serving_revision": state.serving_revision,
        "missing": state.missing,
        "view": state.view().model_dump(),
    }


async def _check(registry: Registry) -> int:
    """Each group's kept state equals a fresh read of the same entries (a cache of its own:
    nothing shared with the registry's); how many were taken as kept. The feed's order of
    its groups is theirs sorted (list pages and this read walk it)."""
    groups, revision, remaining = await registry._every_group()
    feed = registry.seen
    assert isinstance(feed, Feed)
    assert list(feed.order) == sorted(feed.groups)
    assert [gid for gid, _ in groups] == sorted(feed.groups)
    read_at = time.time()
    taken = 0
    for gid, entries in groups:
        before = registry.kept._kept.get(gid)
        kept = registry.kept.state(gid, entries, revision, remaining, read_at, registry.decoded)
        fresh = GroupState.read(
            Snapshot(list(entries), revision, remaining, read_at), gid, Decoded(), brief=True
        )
        assert (kept is None) == (fresh is None), gid
        if kept is not None and fresh is not None:
            assert _fields(kept) == _fields(fresh), gid
            taken += before is not None and kept.agents is before.state.agents
    return taken


def test_kept_states_equal_fresh_reads_through_a_groups_changes(tmp_path: Path) -> None:
    async def body() -> None:
        store = create_store(f"sqlite:///{tmp_path / 'registry.db'}", timeout_s=5.0)
        async with registry_with_feed(store) as (registry, _):
            eid = await _open(registry, "g")
            assert await _check(registry) == 0  # an engine, no agents yet
            assert await _check(registry) == 1  # unchanged: taken as kept
            await _register(registry, "g", eid, range(2))
            assert await _check(registry) == 0
            await _register(registry, "g", eid, range(2, TP))
            await _check(registry)
            await registry.heartbeat_agents("g", eid, list(range(TP)))  # renews, writes no key
            assert await _check(registry) == 1
            await _register(registry, "g", eid, range(1, 2))  # rank 1 again: a new lease
            assert await _check(registry) == 0
            await registry.deregister("g", 3, eid)
            assert await _check(registry) == 0
            await registry.publish_serving(
                "g", ServingRequest(engine_id=eid, url="http://h:8000", model="m")
            )
            assert await _check(registry) == 0
            new = await _open(registry, "g")  # a relaunch: the old agents are not shown
            assert await _check(registry) == 0
            await _register(registry, "g", new, range(TP), ttl_s=5)
            await _check(registry)
            await asyncio.sleep(5.5)  # the lease ends: its agents go (live leases only)
            assert await _check(registry) == 0
            other = await _open(registry, "h")
            await _register(registry, "h", other, range(TP))
            await _check(registry)
            await registry.delete_group("g")
            await _check(registry)
            await registry.group_states()
            assert set(registry.kept._kept) == {"h"}  # what a read did not show is dropped

    asyncio.run(asyncio.wait_for(body(), 60))


async def _expired(events: EventLog) -> list[tuple[str, int]]:
    read = await events.read(limit=1000)
    return [(e.group_id, e.fields["rank"]) for e in read.events if e.kind == "lease_expired"]


def test_the_observer_weighs_a_gone_rank_by_its_latest_expiry(tmp_path: Path) -> None:
    """A group that did not change between two reads keeps what the observer saw of it; a
    rank deregistered after that is weighed against the expiry of the latest read (renewed
    since), not the first: deregistered, not expired. One whose lease ran out is counted once,
    its host remembered while it is missing (counted: the event is recorded by the store
    when it ends a lease, ``Observer.lease_ended``)."""

    async def body() -> None:
        store = create_store(f"sqlite:///{tmp_path / 'registry.db'}", timeout_s=5.0)
        async with registry_with_feed(store) as (registry, _):
            observer = registry.observer
            eid = await _open(registry, "g")
            await _register(registry, "g", eid, range(TP))
            first = await registry.group_states()
            t0 = first[0].expires_at[3] - 30  # the read's instant
            observer.observe(first, now=t0)
            await asyncio.sleep(1.5)
            await registry.heartbeat_agents("g", eid, list(range(TP)))
            second = await registry.group_states()
            assert second[0].agents is first[0].agents  # the same version, taken as kept
            observer.observe(second, now=t0 + 1.5)
            await registry.deregister("g", 3, eid)
            # By the first read's expiry (t0 + 30) rank 3 would look expired at t0 + 29.5;
            # by the latest (t0 + 31.5) it went early: deregistered.
            observer.observe(await registry.group_states(), now=t0 + 29.5)
            assert await _expired(registry.events) == []
            assert observer.last_host("g", eid, 3) == "127.0.0.1"
            # Rank 2's lease runs out (read past its expiry, its agent gone): counted once.
            await registry.deregister("g", 2, eid)
            late = await registry.group_states()
            observer.observe(late, now=late[0].expires_at[1] + 5)
            observer.observe(await registry.group_states(), now=late[0].expires_at[1] + 6)
            assert observer.metrics.lease_expiries._value.get() == 1
            # Its event is the store's to record, when it ends a lease (none ran out here).
            assert await _expired(registry.events) == []
            assert observer.last_host("g", eid, 2) == "127.0.0.1"

    asyncio.run(asyncio.wait_for(body(), 60))
