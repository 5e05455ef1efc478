"""A handshake, an engine's resolution and a group's engine read on etcd: answered from the
replica's watch feed once it has reached a revision read after the request arrived (one read
shared by the requests that came before it was sent), not from about ten Range reads a
handshake (``app/registry/fresh.py``); right after a write, never from a feed behind it.
Real etcd, a real registry process over HTTP and registries in this process with their feed;
the calls etcd served are counted from etcd's own metrics."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest

from app.core.errors import EngineSuperseded, NotReady
from app.core.schemas import (
    HandshakeRequest,
    OpenEngineRequest,
    RegisterAgentRequest,
    RegisterAgentsRequest,
)
from app.registry import Registry
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.feeds import registry_with_feed
from harness.server import RegistryProcess
from tests.support.faults import agent_body, node, open_body

pytestmark = [pytest.mark.store, pytest.mark.timeout(180)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

TP = 8
PLAN = {"tp_size": 1, "rank": 0}  # a decode rank of TP 1: every prefill rank is a target


def ranges(cluster: EtcdCluster) -> float:
    return cluster.metric("grpc_server_started_total", "Range")


def group_reads(http: httpx.Client) -> dict[str, float]:
    """The registry's ``registry_group_reads_total`` by source."""
    found: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("registry_group_reads_total{"):
            found[line.split('source="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.fixture(scope="module")
def http(etcd: EtcdCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("registry") / "registry.log"
    with (
        RegistryProcess(etcd.url("handshakes"), log_path=log) as proc,
        httpx.Client(base_url=proc.url, timeout=10) as client,
    ):
        yield client


def test_reads_of_engines_cost_a_revision_read_not_a_range_read_each(
    etcd: EtcdCluster, http: httpx.Client
) -> None:
    groups = {f"p-{i}": node(http, f"p-{i}", range(TP)) for i in range(4)}
    before, counted = ranges(etcd), group_reads(http)
    reads = 0
    for _ in range(10):
        for gid, eid in groups.items():
            shaken = http.post(f"/engines/{eid}/handshake", json=PLAN)
            assert shaken.status_code == 200, shaken.text
            assert [t["rank"] for t in shaken.json()["targets"]] == list(range(TP))
            assert http.get(f"/engines/{eid}").json()["ready"] is True
            assert http.get(f"/tp-groups/{gid}/engine").json()["engine_id"] == eid
            reads += 3
    served = ranges(etcd) - before
    # 40 handshakes of 10 Range reads each (the engine's index, the group, 8 blobs), 40
    # resolutions of 2, 40 group reads of 1: 520. From the feed: a revision read each (one
    # at a time here, none shared), and each group's blobs read once.
    assert served <= reads + len(groups) + 4, f"{reads} reads made {served:g} Range calls"
    # The registry says where it answered them: each handshake, engine and group read once.
    after = group_reads(http)
    assert after["feed"] - counted["feed"] >= reads - len(groups), (counted, after)
    assert after["store"] - counted["store"] <= len(groups), (counted, after)


def test_concurrent_handshakes_share_one_revision_read(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"shared-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, _):
            eid = await registry_prefill(registry, "g")
            plan = HandshakeRequest.model_validate(PLAN)
            await registry.handshake(eid, plan)  # its blobs read once
            before = ranges(etcd)
            answers = await asyncio.gather(*(registry.handshake(eid, plan) for _ in range(64)))
            served = ranges(etcd) - before
            assert all(len(a.targets) == TP for a in answers)
            assert served <= 4, f"64 handshakes at once made {served:g} Range calls"

    asyncio.run(asyncio.wait_for(body(), 60))


async def registry_prefill(registry: Registry, gid: str, ranks: int = TP, ttl_s: int = 30) -> str:
    opened, _ = await registry.open_engine(
        gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
    )
    items = [{**agent_body(opened.engine_id, r, ttl_s), "rank": r} for r in range(ranks)]
    await registry.register_agents(
        gid, RegisterAgentsRequest.model_validate({"agents": items}), None
    )
    return opened.engine_id


def test_a_handshake_right_after_a_write_sees_it(etcd: EtcdCluster) -> None:
    """Each handshake follows its write at once, in the same task: the feed has not applied
    the write yet (its watch event needs the event loop), so an answer from the feed as it
    stands would be the state before the write."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"fresh-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, _):
            plan = HandshakeRequest.model_validate(PLAN)
            for i in range(10):
                gid = f"g-{i}"
                old = await registry_prefill(registry, gid)
                assert len((await registry.handshake(old, plan)).targets) == TP
                await registry.deregister(gid, 3, old)
                with pytest.raises(NotReady) as gone:
                    await registry.handshake(old, plan)
                assert gone.value.extras["missing_ranks"] == [3]
                again = RegisterAgentRequest.model_validate(agent_body(old, 3))
                await registry.register_agent(gid, 3, again, None)
                assert len((await registry.handshake(old, plan)).targets) == TP
                new, _ = await registry.open_engine(
                    gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
                )
                with pytest.raises(EngineSuperseded):
                    await registry.handshake(old, plan)
                with pytest.raises(NotReady):
                    await registry.handshake(new.engine_id, plan)
                assert (await registry.get_engine(gid)).engine_id == new.engine_id

    asyncio.run(asyncio.wait_for(body(), 90))


def test_a_rank_whose_lease_ran_out_is_not_a_target(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper held off: etcd keeps the expired agent's keys (the lease's headroom) and the
    feed still shows them; the lease's time left says it is gone."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"expired-{uuid.uuid4().hex}"), timeout_s=5.0)
        monkeypatch.setattr(store.reaper, "start", lambda: None)
        async with registry_with_feed(store) as (registry, feed):
            eid = await registry_prefill(registry, "g", ttl_s=5)
            plan = HandshakeRequest.model_validate(PLAN)
            assert len((await registry.handshake(eid, plan)).targets) == TP
            await asyncio.sleep(5.5)
            assert len(feed.groups["g"]) == 1 + TP  # the agents still in etcd and the feed
            with pytest.raises(NotReady) as gone:
                await registry.handshake(eid, plan)
            assert gone.value.extras["missing_ranks"] == list(range(TP))
            assert (await registry.get_engine("g")).missing_ranks == list(range(TP))
            assert (await registry.resolve(eid)).missing == list(range(TP))

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_feed_left_behind_sends_the_handshake_to_the_store(etcd: EtcdCluster) -> None:
    """The feed stops following (closed) with every rank live: what it shows it shows for
    ever. After a deregistration the handshake reads the store: 503 for that rank."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"behind-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            eid = await registry_prefill(registry, "g")
            plan = HandshakeRequest.model_validate(PLAN)
            assert len((await registry.handshake(eid, plan)).targets) == TP
            await feed.close()
            await registry.deregister("g", 5, eid)
            assert feed.groups["g"].get("groups/g/agents/00005") is not None
            with pytest.raises(NotReady) as gone:
                await registry.handshake(eid, plan)
            assert gone.value.extras["missing_ranks"] == [5]
            assert (await registry.get_engine("g")).missing_ranks == [5]

    asyncio.run(asyncio.wait_for(body(), 60))
