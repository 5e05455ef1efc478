"""An open on etcd decided on the replica's watch feed (``EnginesMixin._open_as_seen``): a new
launch costs one transaction and no read of etcd, and a feed that is behind (its changes held
back here, the feed still following) never makes a wrong answer: the transaction's compares
fail and the open reads etcd and decides as before. Real etcd, registries in this process;
the reads etcd served are counted from etcd's own metrics."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from app.core.errors import LaunchSuperseded
from app.core.schemas import OpenEngineRequest
from app.registry import Registry
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.feeds import registry_with_feed
from tests.support.faults import open_body

pytestmark = pytest.mark.store

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

GROUPS = 10


def launch(launch_id: str | None = None) -> OpenEngineRequest:
    return OpenEngineRequest.model_validate(open_body(launch_id, tp_size=2))


def test_opens_and_relaunches_the_feed_shows_read_nothing_from_etcd(etcd: EtcdCluster) -> None:
    def ranges() -> float:
        return etcd.metric("grpc_server_started_total", "Range")

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(f"open-{uuid.uuid4().hex}"), timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            before = ranges()
            first = [await registry.open_engine(f"g{i}", launch()) for i in range(GROUPS)]
            opened = ranges() - before
            assert all(created and e.generation == 1 for e, created in first)
            assert await feed.reached(await store.revision(), 5.0)
            assert all(f"g{i}" in feed.groups for i in range(GROUPS))  # each engine's key
            before = ranges()
            again = [await registry.open_engine(f"g{i}", launch()) for i in range(GROUPS)]
            relaunched = ranges() - before
            assert all(created and e.generation == 2 for e, created in again)
            # Read from etcd, each open would be two reads (the group, the launch's key).
            assert opened == 0, f"{GROUPS} opens of new groups made {opened:g} reads"
            assert relaunched == 0, f"{GROUPS} relaunches made {relaunched:g} reads"
            # A retried open of the current launch reads etcd (the feed may be behind it).
            current = again[0][0]
            retried, created = await registry.open_engine("g0", launch(current.launch_id))
            assert (retried.engine_id, created) == (current.engine_id, False)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_feed_held_behind_gives_the_answers_a_read_of_etcd_gives(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 1's feed shows launch 1 for ever (its changes are held back; it still says it
    is following) while replica 2 relaunches the group: replica 1's opens must still make
    generation 3, refuse superseded launches and give the current launch back."""

    async def body() -> None:
        url = etcd.url(f"behind-{uuid.uuid4().hex}")
        one = EtcdStore.from_url(url, timeout_s=5.0)
        two = EtcdStore.from_url(url, timeout_s=5.0)
        await two.start()
        other = Registry(two)  # no feed: every open reads etcd
        try:
            async with registry_with_feed(one) as (registry, feed):
                l1, l2, l3 = (uuid.uuid4().hex for _ in range(3))
                first, _ = await registry.open_engine("g", launch(l1))
                assert await feed.reached(await one.revision(), 5.0)
                assert "groups/g/engine" in feed.groups["g"]
                monkeypatch.setattr(feed, "_apply", lambda batch: None)
                second, created = await other.open_engine("g", launch(l2))
                assert (created, second.generation) == (True, 2)
                assert feed.following
                assert l1.encode() in feed.groups["g"]["groups/g/engine"].value  # held behind

                third, created = await registry.open_engine("g", launch(l3))
                assert (created, third.generation) == (True, 3), third
                for old in (l2, l1):  # l1 is what the feed shows as current
                    with pytest.raises(LaunchSuperseded, match="superseded"):
                        await registry.open_engine("g", launch(old))
                back, created = await registry.open_engine("g", launch(l3))
                assert (back.engine_id, created) == (third.engine_id, False)
                seen_by_two = await other.get_engine("g")
                assert (seen_by_two.engine_id, seen_by_two.generation) == (third.engine_id, 3)
                assert first.generation == 1
        finally:
            await two.close()

    asyncio.run(asyncio.wait_for(body(), 60))
