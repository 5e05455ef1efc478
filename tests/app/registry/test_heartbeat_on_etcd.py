"""A node's heartbeat on etcd: the leases the replica's watch feed shows are renewed, and the
answer comes from the feed once it has reached the renewals' revision, not from a range read
of the group (``app.registry.renewals``). Real etcd, real registry process, real HTTP; the
calls etcd served are counted from etcd's own metrics."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from app.core.errors import NotFound
from app.core.schemas import OpenEngineRequest, RegisterAgentsRequest
from app.store import ChangeBatch
from app.store.lease_clock import CLOCK
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.feeds import registry_with_feed
from harness.server import RegistryProcess
from tests.support.faults import (
    agent_body,
    node,
    node_beat,
    open_body,
    refused_after_deregistration,
)

pytestmark = pytest.mark.store

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

TP = 8
WATCH_MESSAGES = "grpc_server_msg_received_total"  # etcd's count of a method's messages


@pytest.fixture(scope="module")
def registry(
    etcd: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    log = tmp_path_factory.mktemp("registry") / "registry.log"
    with RegistryProcess(etcd.url("heartbeats"), log_path=log) as proc:
        yield proc


@pytest.fixture
def http(registry: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=registry.url, timeout=10) as client:
        yield client


def served(cluster: EtcdCluster, method: str) -> float:
    """How many calls of ``method`` etcd has started (streams count once)."""
    return cluster.metric("grpc_server_started_total", method)


def test_node_heartbeats_renew_on_a_few_streams_without_a_range_read(
    etcd: EtcdCluster, http: httpx.Client
) -> None:
    groups = {f"hb-{i}": node(http, f"hb-{i}", range(TP)) for i in range(10)}
    ranges, streams = served(etcd, "Range"), served(etcd, "LeaseKeepAlive")
    for _ in range(5):
        for gid, eid in groups.items():
            answer = node_beat(http, gid, eid, list(range(TP)))
            assert answer.status_code == 200, answer.text
            assert [a["rank"] for a in answer.json()["agents"]] == list(range(TP))
        one = {"engine_id": groups["hb-0"]}
        single = http.post("/tp-groups/hb-0/engine/agents/3/heartbeat", json=one)
        assert single.status_code == 200, single.text
    ranges = served(etcd, "Range") - ranges
    streams = served(etcd, "LeaseKeepAlive") - streams
    # 55 heartbeats; the range read per heartbeat (the path for stores without a feed's
    # revision) would be 55 Range calls.
    assert ranges <= 3, f"55 heartbeats made {ranges:g} range reads"
    assert streams <= 4, f"55 heartbeats opened {streams:g} keep-alive streams"


def test_a_heartbeat_right_after_a_deregistration_names_the_rank(http: httpx.Client) -> None:
    """Rank 0 deregistered, the lease lives on (rank 1 holds it): the feed may not have the
    deletion yet when the heartbeat renews the lease, and the answer must still be 404."""
    for i in range(30):
        refused_after_deregistration(http, f"dereg-{i}", i)


def test_a_heartbeat_right_after_a_relaunch_is_refused(http: httpx.Client) -> None:
    for i in range(20):
        gid = f"relaunch-{i}"
        old = node(http, gid, range(TP))
        new = http.put(f"/tp-groups/{gid}/engine", json=open_body(tp_size=TP)).json()
        assert new["engine_id"] != old
        answer = node_beat(http, gid, old, list(range(TP)))
        assert answer.status_code == 409, (i, answer.text)
        assert answer.json()["type"].endswith("engine_id_mismatch"), answer.text


def test_a_feed_left_behind_sends_the_heartbeat_to_the_range_read(etcd: EtcdCluster) -> None:
    """The feed stops following (closed) after a registration: it shows the rank live for
    ever. A heartbeat after the rank's deregistration renews the lease (rank 1 holds it),
    finds the feed behind the renewal's revision and takes the range read: 404."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"behind-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            opened, _ = await registry.open_engine(
                "g", OpenEngineRequest.model_validate(open_body(tp_size=2))
            )
            eid = opened.engine_id
            items = [{**agent_body(eid, r), "rank": r} for r in range(2)]
            await registry.register_agents(
                "g", RegisterAgentsRequest.model_validate({"agents": items}), None
            )
            assert await feed.reached(await store.revision(), 5.0)
            assert len(feed.groups["g"]) == 3  # the engine and both agents
            assert (await registry.renew_agents("g", eid, [0, 1]))[0][0] == 0
            await feed.close()  # what it shows now it shows for ever
            await registry.deregister("g", 0, eid)
            assert feed.groups["g"].get("groups/g/agents/00000") is not None
            with pytest.raises(NotFound, match="rank 0"):
                await registry.renew_agents("g", eid, [0, 1])
            assert [r for r, _ in await registry.renew_agents("g", eid, [1])] == [1]

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_heartbeat_renewed_in_memory_reaches_a_late_feed_without_asking_etcd(
    etcd_single: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lazy renewals (``REGISTRY_ETCD_RENEW_WINDOW_S``): a heartbeat's renewal answers with the
    journal write's revision, and that write is an event on the feed's own watch. A feed
    behind it (each batch held 0.2 s here, as the feed lags in a launch) gets there unasked:
    the heartbeats ask etcd for no progress report. Before, each waiting heartbeat asked for
    one (a Watch message etcd answers): 6 heartbeats, 6 asks. An etcd of its own: its Watch
    messages are this store's."""
    monkeypatch.setattr(CLOCK, "etcd_window_s", 20.0)

    async def body() -> None:
        store = EtcdStore.from_url(etcd_single.url(f"late-{uuid.uuid4().hex}"), timeout_s=5.0)
        changes = store.changes

        def late(*args: object, **kwargs: object) -> AsyncIterator[ChangeBatch]:
            async def held() -> AsyncIterator[ChangeBatch]:
                stream = changes(*args, **kwargs)  # type: ignore[arg-type]
                async with contextlib.aclosing(stream):  # its watch ends with the feed's
                    async for batch in stream:
                        await asyncio.sleep(0.2)
                        yield batch

            return held()

        monkeypatch.setattr(store, "changes", late)
        async with registry_with_feed(store) as (registry, feed):
            opened, _ = await registry.open_engine(
                "g", OpenEngineRequest.model_validate(open_body(tp_size=TP))
            )
            eid = opened.engine_id
            items = [{**agent_body(eid, r), "rank": r} for r in range(TP)]
            await registry.register_agents(
                "g", RegisterAgentsRequest.model_validate({"agents": items}), None
            )
            assert await feed.reached(await store.revision(), 5.0)
            before = await asyncio.to_thread(etcd_single.metric, WATCH_MESSAGES, "Watch")
            for _ in range(6):
                renewed = await registry.renew_agents("g", eid, list(range(TP)))
                assert [rank for rank, _ in renewed] == list(range(TP))
            asks = await asyncio.to_thread(etcd_single.metric, WATCH_MESSAGES, "Watch")
            assert asks - before <= 1, f"6 heartbeats sent {asks - before:g} Watch messages"

    asyncio.run(asyncio.wait_for(body(), 60))
