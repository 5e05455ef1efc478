"""GET /events: refusals and handshakes recorded with their time, bounded in the store.

A registry of its own (tokens, a small ``--events-keep``) on SQLite, and one on a real etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.metrics import Metrics
from app.registry.events import EventLog
from app.store import Store
from app.store.sqlite.store import SqliteStore
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.app.api.conftest import Api, agent_body, invalid, launch, new_gid, problem

pytestmark = pytest.mark.api

READER = "reader-token-events-0123456789"
WORKER = "worker-token-events-0123456789"
KEEP = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("events")
    (d / "tokens").write_text(f"reader:{READER}\nworker:{WORKER}\n")
    with RegistryProcess(
        f"sqlite:///{d / 'registry.db'}",
        args=["--tokens-file", str(d / "tokens"), "--events-keep", str(KEEP)],
        log_path=d / "registry.log",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def api(server: RegistryProcess) -> Iterator[httpx.Client]:
    auth = {"Authorization": f"Bearer {WORKER}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30.0) as c:
        yield c


def events(c: httpx.Client, **params: Any) -> dict[str, Any]:
    r = c.get("/events", params=params)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def mine(c: httpx.Client, gid: str) -> list[dict[str, Any]]:
    return [e for e in events(c, limit=1000)["events"] if e["group_id"] == gid]


def test_refusals_are_recorded_with_their_cause_and_fields(api: httpx.Client) -> None:
    reg = Api(api)
    gid, other = new_gid("ev"), new_gid("ev")
    first = reg.open(gid, compat={"model": "m", "block_size": 16})
    reg.open(other)
    api.put(f"/tp-groups/{gid}/engine/agents/0", json=agent_body(first["engine_id"], 0))
    lid = launch()
    reg.open(gid, launch_id=lid, compat={"model": "m", "block_size": 16})
    reg.open(gid, compat={"model": "m", "block_size": 16})  # supersedes lid's generation
    second_old = api.put(
        f"/tp-groups/{gid}/engine",
        json={"launch_id": lid, "tp_size": 2, "role": "prefill"},
    )
    problem(second_old, 409, "launch_superseded")
    for engine_id in (first["engine_id"], "made-up-by-a-node"):
        r = api.put(f"/tp-groups/{gid}/engine/agents/1", json=agent_body(engine_id, 1))
        problem(r, 409, "engine_id_mismatch")
    other_eid = api.get(f"/tp-groups/{other}/engine").json()["engine_id"]
    problem(
        api.put(f"/tp-groups/{gid}/engine/agents/1", json=agent_body(other_eid, 1)),
        409,
        "engine_id_mismatch",
    )
    problem(
        api.post(f"/engines/{first['engine_id']}/handshake", json={"tp_size": 2, "rank": 0}),
        410,
        "engine_superseded",
    )
    current = api.get(f"/tp-groups/{gid}/engine").json()["engine_id"]
    bad = {"tp_size": 2, "rank": 0, "compat": {"model": "other", "block_size": 32}}
    problem(api.post(f"/engines/{current}/handshake", json=bad), 409, "incompatible")

    seen = mine(api, gid)
    causes = sorted(e["fields"]["cause"] for e in seen if e["kind"] == "engine_id_mismatch")
    assert causes == ["other_group", "superseded", "unknown"]
    kinds = {e["kind"] for e in seen}
    assert {"launch_superseded", "engine_superseded", "incompatible"} <= kinds
    (incompatible,) = [e for e in seen if e["kind"] == "incompatible"]
    fields = {m["field"] for m in incompatible["fields"]["mismatches"]}
    assert fields == {"model", "block_size"}
    for e in seen:
        assert e["at"].endswith("Z")
        assert e["detail"]
    assert [e["id"] for e in seen] == sorted(e["id"] for e in seen)


def test_a_handshake_is_recorded_once_per_decode_rank_and_engine(api: httpx.Client) -> None:
    reg = Api(api)
    gid = new_gid("hs")
    eid = reg.open(gid, tp_size=2)["engine_id"]
    for rank in range(2):
        api.put(f"/tp-groups/{gid}/engine/agents/{rank}", json=agent_body(eid, rank))
    for _ in range(30):
        r = api.post(f"/engines/{eid}/handshake", json={"tp_size": 4, "rank": 3})
        assert r.status_code == 200, r.text
    (only,) = [e for e in mine(api, gid) if e["kind"] == "handshake"]
    assert only["fields"]["decode_ranks"] == [3]
    assert only["fields"]["decode_tp_size"] == 4
    assert only["fields"]["target_ranks"] == [1]
    assert only["fields"]["engine_id"] == eid
    assert only["count"] == 1
    api.post(f"/engines/{eid}/handshake", json={"tp_size": 4, "rank": 0})
    handshakes = [e for e in mine(api, gid) if e["kind"] == "handshake"]
    assert sorted({r for e in handshakes for r in e["fields"]["decode_ranks"]}) == [0, 3]
    assert len(handshakes) <= 2


def test_since_and_limit_page_through_events(api: httpx.Client) -> None:
    start = events(api, limit=1)["last_id"]
    gid = new_gid("pg")
    Api(api).open(gid)
    for i in range(5):
        body = agent_body(f"unknown-{i}", 0)
        problem(api.put(f"/tp-groups/{gid}/engine/agents/0", json=body), 409, "engine_id_mismatch")
    page = events(api, since=start, limit=3)
    assert page["truncated"] is True
    assert [e["fields"]["got_engine_id"] for e in page["events"]] == [
        f"unknown-{i}" for i in (2, 3, 4)
    ]
    assert events(api, since=page["last_id"])["events"] == []
    at = page["events"][0]["at"]
    from_time = events(api, since=at, limit=1000)["events"]
    assert from_time[0]["id"] <= page["events"][0]["id"]
    for bad in ("yesterday", "2026-13-45T25:61:61Z", "0001-01-01T00:00:00+01:00", "x" * 65):
        invalid(api.get("/events", params={"since": bad}))
    invalid(api.get("/events", params={"limit": 0}))


def test_events_need_a_reader_and_basic_credentials_only_read(server: RegistryProcess) -> None:
    url = server.url
    problem(httpx.get(f"{url}/events"), 401, "unauthorized")
    denied = httpx.get(f"{url}/status")
    problem(denied, 401, "unauthorized")
    assert any(v.startswith("Basic") for v in denied.headers.get_list("www-authenticate"))
    assert httpx.get(f"{url}/events", auth=("anyone", READER)).status_code == 200
    assert httpx.get(f"{url}/status", auth=("anyone", READER)).status_code == 200
    body = {"launch_id": launch(), "tp_size": 1, "role": "prefill"}
    # A browser's cached credentials never change state: Basic is for reads only.
    refused = httpx.put(f"{url}/tp-groups/{new_gid()}/engine", json=body, auth=("x", WORKER))
    problem(refused, 401, "unauthorized")


def test_events_are_kept_in_the_store_and_bounded(
    server: RegistryProcess, api: httpx.Client
) -> None:
    # Spread over groups: past 16 distinct refusals for one group within a second they fold.
    gids = [new_gid("bd") for _ in range(3 * KEEP // 10)]
    for gid in gids:
        Api(api).open(gid)
    for i in range(3 * KEEP):
        body = agent_body(f"stray-{i:03d}", 0)
        where = f"/tp-groups/{gids[i % len(gids)]}/engine/agents/0"
        assert api.put(where, json=body).status_code == 409
    server.stop()  # a clean stop writes what was buffered
    server.start()
    kept = events(api, limit=1000)["events"]
    assert KEEP <= len(kept) <= KEEP + KEEP // 10
    assert kept[-1]["fields"]["got_engine_id"] == f"stray-{3 * KEEP - 1:03d}"  # the newest


async def _flush_and_trim(store: Store) -> list[str]:
    """300 distinct events buffered, one flush: written in transactions of at most 100
    operations, then trimmed to the newest 100 in transactions of deletes. (etcd documents
    --max-txn-ops 128 as its default, but the Debian etcd 3.4 here took a 300-put transaction
    too, so this checks the batched write and the trim, not that etcd's limit is kept.)"""
    log = EventLog(store, Metrics(), keep=100)
    try:
        for i in range(300):
            log.record("engine_id_mismatch", f"g{i}", f"refusal {i}", i, {"n": i})
        await log.flush()
        answer = await log.read(limit=1000)
        stored = await store.range("events/")
    finally:
        await log.close()
        await store.close()
    assert len(stored.entries) == 100
    assert answer.truncated is False
    return [e.detail for e in answer.events]


def test_the_store_keeps_the_newest_events_on_sqlite(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "registry.db", timeout_s=5.0)
    details = asyncio.run(_flush_and_trim(store))
    assert details == [f"refusal {i}" for i in range(200, 300)]


@pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)
def test_the_store_keeps_the_newest_events_on_etcd(tmp_path: Path) -> None:
    from app.store.etcd.store import EtcdStore

    with EtcdCluster(tmp_path / "etcd", size=1) as etcd:
        store = EtcdStore.from_url(etcd.url("events"), timeout_s=5.0)
        details = asyncio.run(_flush_and_trim(store))
    assert details == [f"refusal {i}" for i in range(200, 300)]
