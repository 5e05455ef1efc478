"""A node's registration on etcd decided on the replica's watch feed (``_seen_for_write``):
no Range read a registration once the feed shows the group (one each before: 12,500 at a
100,000-rank launch); a feed behind the store never registers against what it shows, nor
refuses on it. Real etcd, a registry in this process with its feed; the Range calls etcd
served counted from etcd's own metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from app.core.errors import EngineIdMismatch, NotFound
from app.core.schemas import OpenEngineRequest, RegisterAgentsRequest
from app.registry import Registry
from app.watch.feed import Feed
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.feeds import registry_with_feed
from tests.support.faults import agent_body, open_body

pytestmark = [pytest.mark.store, pytest.mark.timeout(120)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

TP = 8


def ranges(cluster: EtcdCluster) -> float:
    return cluster.metric("grpc_server_started_total", "Range")


async def open_group(registry: Registry, gid: str) -> str:
    opened, _ = await registry.open_engine(
        gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
    )
    return opened.engine_id


def batch(eid: str) -> RegisterAgentsRequest:
    items = [{**agent_body(eid, r), "rank": r} for r in range(TP)]
    return RegisterAgentsRequest.model_validate({"agents": items})


async def shown(feed: Feed, gid: str, key: str, eid: str) -> None:
    """Until the feed shows ``key`` of ``gid`` holding ``eid`` (5 s at most)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        entry = feed.groups.get(gid, {}).get(key)
        if entry is not None and eid.encode() in entry.value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the feed never showed {key} of {gid} with {eid}")


def test_registrations_the_feed_has_seen_read_no_range(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"seen-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            engines = {f"g{i}": await open_group(registry, f"g{i}") for i in range(20)}
            for gid, eid in engines.items():
                await shown(feed, gid, f"groups/{gid}/engine", eid)
            before = ranges(etcd)
            for gid, eid in engines.items():
                answer = await registry.register_agents(gid, batch(eid), None)
                assert answer.created_ranks == list(range(TP))
            served = ranges(etcd) - before
            assert served <= 2, f"20 registrations made {served:g} Range calls (one each before)"
            for gid, eid in engines.items():  # each as the store has it
                state = await registry.get_engine(gid)
                assert state.engine_id == eid
                assert state.ready

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_feed_behind_a_relaunch_neither_registers_nor_refuses_on_it(etcd: EtcdCluster) -> None:
    """The feed shows the old launch (its view of the group put back after the relaunch
    arrived, as a feed lagging behind would show it): the new launch's ranks are registered
    (the store's state decides, not the feed's refusal), the old launch's are refused as
    superseded (the feed's compare loses, the store's state refuses)."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"behind-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            old = await open_group(registry, "g")
            await shown(feed, "g", "groups/g/engine", old)
            stale = feed.groups["g"]
            new = await open_group(registry, "g")
            await shown(feed, "g", "groups/g/engine", new)
            feed.groups["g"] = stale
            with pytest.raises(EngineIdMismatch) as refused:
                await registry.register_agents("g", batch(old), None)
            assert "superseded by generation 2" in str(refused.value)
            feed.groups["g"] = stale
            answer = await registry.register_agents("g", batch(new), None)
            assert answer.created_ranks == list(range(TP))
            # As the store has it (the feed's view of "g" stays what the test put back).
            snap = await store.range("groups/g/")
            engine = [e for e in snap.entries if e.key == "groups/g/engine"]
            assert len(engine) == 1
            assert new.encode() in engine[0].value
            agents = [e for e in snap.entries if "/agents/" in e.key]
            assert len(agents) == TP
            assert all(new.encode() in e.value for e in agents)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_heartbeat_follows_its_node_through_a_registration_again(etcd: EtcdCluster) -> None:
    """A node's heartbeat answered from the feed, then the node registered again (a new lease,
    the old one revoked): its next heartbeat renews the new lease from the feed (no Range
    read: what it kept of the last answer is not reused for a changed group); after a
    deregistration it names the rank gone."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"again-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            eid = await open_group(registry, "g")
            await registry.register_agents("g", batch(eid), None)
            await shown(feed, "g", "groups/g/agents/00007", eid)
            first = feed.groups["g"]["groups/g/agents/00000"].lease
            await registry.renew_agents("g", eid, list(range(TP)))
            await registry.register_agents("g", batch(eid), None)
            await shown(feed, "g", "groups/g/agents/00007", eid)
            deadline = time.monotonic() + 5
            while feed.groups["g"]["groups/g/agents/00000"].lease == first:
                assert time.monotonic() < deadline, "the feed never showed the new lease"
                await asyncio.sleep(0.01)
            before = ranges(etcd)
            renewed = await registry.renew_agents("g", eid, list(range(TP)))
            assert [r for r, _ in renewed] == list(range(TP))
            assert ranges(etcd) - before == 0
            await registry.deregister("g", 3, eid)
            with pytest.raises(NotFound) as gone:
                await registry.renew_agents("g", eid, list(range(TP)))
            assert "rank 3" in str(gone.value)

    asyncio.run(asyncio.wait_for(body(), 60))
