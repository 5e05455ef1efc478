"""etcd's request limit, as etcd ships it (``--max-request-bytes`` 1.5 MiB), against a real
registry process (issue #22): a registration etcd can never accept is answered 413 at once,
naming the limit, not retried for the whole store timeout; an event the store refuses for
its size never stops the events written after it."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.core.metrics import Metrics
from app.registry.events import Event, EventLog
from app.store.etcd.store import EtcdStore
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.support.faults import agent_body
from tests.support.hostile import assert_problem, open_engine

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

STORE_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1, max_request_bytes=None) as c:
        yield c


@pytest.fixture(scope="module")
def registry(
    etcd: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    where = tmp_path_factory.mktemp("registry")
    with RegistryProcess(
        etcd.url("limits"),
        args=["--store-timeout", f"{STORE_TIMEOUT_S:g}"],
        log_path=where / "registry.log",
    ) as proc:
        yield proc


def stored_events(etcd: EtcdCluster) -> list[Event]:
    async def read() -> list[Event]:
        store = EtcdStore.from_url(etcd.url("limits"), timeout_s=5.0)
        try:
            snap = await store.range("events/")
        finally:
            await store.close()
        return [Event.model_validate_json(e.value) for e in snap.entries]

    return asyncio.run(read())


def test_a_blob_over_etcds_limit_is_answered_413_at_once_naming_it(
    registry: RegistryProcess,
) -> None:
    with httpx.Client(base_url=registry.url, timeout=30.0) as http:
        eid = open_engine(http, "big-blob", tp_size=1)["engine_id"]
        body = agent_body(eid, 0) | {
            "agent_metadata": base64.b64encode(os.urandom(2_500_000)).decode()
        }
        t0 = time.monotonic()
        answer = http.put("/tp-groups/big-blob/engine/agents/0", json=body)
        took = time.monotonic() - t0
        problem = assert_problem(answer, 413, "payload_too_large")
        assert "--max-request-bytes" in problem["detail"]
        assert took < STORE_TIMEOUT_S / 2, f"answered after {took:.1f} s"
        assert http.get("/tp-groups/big-blob/engine").json()["registered_ranks"] == []


def test_an_oversized_refusal_never_stops_later_events(
    registry: RegistryProcess, etcd: EtcdCluster
) -> None:
    with httpx.Client(base_url=registry.url, timeout=30.0) as http:
        eid = open_engine(http, "big-event", tp_size=1, compat={"model": "m"})["engine_id"]
        r = http.put("/tp-groups/big-event/engine/agents/0", json=agent_body(eid, 0, ttl_s=600))
        assert r.status_code == 201
        huge = {"tp_size": 1, "rank": 0, "compat": {"model": "x" * 1_600_000}}
        assert http.post(f"/engines/{eid}/handshake", json=huge).status_code in (409, 422)
        time.sleep(1.2)  # the next write is another flush
        fine = http.post(f"/engines/{eid}/handshake", json={"tp_size": 1, "rank": 0})
        assert fine.status_code == 200
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        kinds = [e.kind for e in stored_events(etcd) if e.group_id == "big-event"]
        if "handshake" in kinds:
            break
        time.sleep(0.5)
    assert "handshake" in kinds, "the handshake after the oversized refusal was never stored"
    log = Path(registry.log_path or "").read_text()
    assert log.count("events not written yet") <= 1


def test_the_writer_drops_what_etcd_refuses_for_size_and_writes_the_rest(
    etcd: EtcdCluster,
) -> None:
    async def run() -> tuple[list[str], float]:
        store = EtcdStore.from_url(etcd.url("writer"), timeout_s=STORE_TIMEOUT_S)
        metrics = Metrics()
        events = EventLog(store, metrics, keep=100)
        try:
            events.record("lease_expired", "g", "before", "a", {"rank": 0})
            # An event past etcd's limit, as no client can make one any more: built by hand.
            giant = events._new("lease_expired", "g", "giant", {})
            giant.detail = "x" * 1_700_000
            events._others[("giant",)] = giant
            events.record("lease_expired", "g", "after", "b", {"rank": 1})
            t0 = time.monotonic()
            await events.flush()
            took = time.monotonic() - t0
            await events.flush()  # nothing left to resend
            stored = await store.range("events/")
            dropped = metrics.registry.get_sample_value("registry_events_dropped_total")
        finally:
            await events.close()
            await store.close()
        assert dropped == 1
        return [Event.model_validate_json(e.value).detail for e in stored.entries], took

    details, took = asyncio.run(run())
    assert details == ["before", "after"]
    assert took < STORE_TIMEOUT_S / 2
