"""An operator's read of every group (the status page, /metrics' gauges) comes from the
replica's watch feed, caught up to the store's revision, not from a range read of every group
(``RegistryBase._every_group``): on etcd that read is every agent's blob (800 MB at 100,000
ranks, about 6 s a read). Real etcd and a real SQLite file; a real registry process over real
HTTP where the bytes etcd sends are counted from etcd's own metrics."""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.schemas import OpenEngineRequest, RegisterAgentsRequest
from app.registry import Registry
from app.registry.state import GroupState
from app.store import create_store
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.feeds import registry_with_feed
from harness.server import RegistryProcess
from tests.support.faults import agent_body, open_body

pytestmark = pytest.mark.store

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

TP = 8
BLOB = 4096  # about a real rank's NIXL metadata (docs/benchmarks.md)
GROUPS = 16


def sent_bytes(cluster: EtcdCluster) -> float:
    """Bytes etcd has sent its gRPC clients."""
    return cluster.metric("etcd_network_client_grpc_sent_bytes_total")


def _agents(eid: str, ranks: range) -> dict[str, Any]:
    blob = base64.b64encode(os.urandom(BLOB)).decode()
    return {"agents": [{**agent_body(eid, r), "rank": r, "agent_metadata": blob} for r in ranks]}


def test_status_and_metrics_do_not_read_every_blob_from_etcd(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    with (
        RegistryProcess(etcd.url("states"), log_path=tmp_path / "registry.log") as proc,
        httpx.Client(base_url=proc.url, timeout=30) as http,
    ):
        for i in range(GROUPS):
            gid = f"fleet-{i:02d}"
            opened = http.put(f"/tp-groups/{gid}/engine", json=open_body(tp_size=TP))
            assert opened.status_code == 201, opened.text
            ranks = range(1) if i == 0 else range(TP)  # fleet-00 is not ready
            answer = http.put(
                f"/tp-groups/{gid}/engine/agents", json=_agents(opened.json()["engine_id"], ranks)
            )
            assert answer.status_code == 200, answer.text
        blobs = GROUPS * TP * BLOB  # what a range read of every group would carry, at least
        before = sent_bytes(etcd)
        status = http.get("/status")
        metrics = http.get("/metrics")
        sent = sent_bytes(etcd) - before
        assert status.status_code == 200, status.text
        assert all(f"fleet-{i:02d}" in status.text for i in range(GROUPS))
        assert "registry_groups 16.0" in metrics.text, metrics.text
        assert "registry_ready_groups 15.0" in metrics.text, metrics.text
        assert sent < blobs / 16, f"a status page and a scrape took {sent:g} bytes from etcd"


async def _node(registry: Registry, gid: str, ranks: range) -> str:
    opened, _ = await registry.open_engine(
        gid, OpenEngineRequest.model_validate(open_body(tp_size=TP))
    )
    body = RegisterAgentsRequest.model_validate(_agents(opened.engine_id, ranks))
    await registry.register_agents(gid, body, None)
    return opened.engine_id


def _shown(states: list[GroupState]) -> list[dict[str, Any]]:
    return [
        state.view().model_dump(exclude={"agents": {"__all__": {"expires_at"}}}) for state in states
    ]


@pytest.mark.parametrize("kind", ["sqlite", "etcd"])
def test_the_feed_shows_what_a_range_read_shows(
    kind: str, etcd: EtcdCluster, tmp_path: Path
) -> None:
    """Ready, not ready, a rank deregistered, a relaunch: the same groups either way, each
    write seen by the read right after it (the feed is caught up first); a feed that stopped
    following gives the read back to the store."""

    async def body() -> None:
        url = (
            f"sqlite:///{tmp_path / 'registry.db'}"
            if kind == "sqlite"
            else etcd.url(f"feed-{uuid.uuid4().hex}")
        )
        store = create_store(url, timeout_s=5.0)
        async with registry_with_feed(store) as (registry, feed):
            await _node(registry, "ready", range(TP))
            await _node(registry, "partial", range(3))
            gone = await _node(registry, "dereg", range(TP))
            await registry.deregister("dereg", 5, gone)
            await _node(registry, "relaunched", range(TP))
            await _node(registry, "relaunched", range(2))  # the new launch, 2 ranks so far
            from_feed = await registry.group_states()  # right after the writes
            assert [s.engine.group_id for s in from_feed] == [
                "dereg",
                "partial",
                "ready",
                "relaunched",
            ]
            assert [sorted(s.agents) for s in from_feed] == [
                [0, 1, 2, 3, 4, 6, 7],
                [0, 1, 2],
                list(range(TP)),
                [0, 1],
            ]
            registry.seen = None
            assert _shown(await registry.group_states()) == _shown(from_feed)
            registry.seen = feed
            await feed.close()  # no longer following: the store's range read answers
            assert not feed.following
            await _node(registry, "late", range(TP))
            late = await registry.group_states()
            assert [s.engine.group_id for s in late] == [
                "dereg",
                "late",
                "partial",
                "ready",
                "relaunched",
            ]

    asyncio.run(asyncio.wait_for(body(), 60))
