"""The handshake's ``decode`` field is checked (issue #39, item 6), through a real registry
process on SQLite and on etcd: a decode group that does not exist answers 404 (naming it in
``decode_group_id``), a prefill group named as the decode 409 ``incompatible`` (field
``decode.role``), an engine id that is not the decode group's current engine 409
``engine_id_mismatch`` with its cause; and the handshake event records the decode side as
verified, so a forged one made first cannot hide the genuine one."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.etcd import SKIP_REASON, etcd_available
from harness.server import RegistryProcess
from tests.app.store.conftest import shared_etcd
from tests.support.faults import agent_body, open_body

pytestmark = [pytest.mark.store, pytest.mark.timeout(120)]

EVENT_WAIT_S = 5.0


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    directory = tmp_path_factory.mktemp(f"decode-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{directory / 'registry.db'}"
    elif not etcd_available():
        pytest.skip(SKIP_REASON)
    else:
        url = shared_etcd().url(f"decode-{uuid.uuid4().hex}")
    args = ["--no-access-log"]
    with (
        RegistryProcess(url, args=args, log_path=directory / "registry.log") as proc,
        httpx.Client(base_url=proc.url, timeout=30.0) as client,
    ):
        yield client


def gid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def opened(api: httpx.Client, group: str, role: str, launch_id: str | None = None) -> str:
    resp = api.put(f"/tp-groups/{group}/engine", json=open_body(launch_id, 1, role))
    assert resp.status_code in (200, 201), resp.text
    engine_id: str = resp.json()["engine_id"]
    return engine_id


def ready_prefill(api: httpx.Client) -> str:
    group = gid("p")
    eid = opened(api, group, "prefill")
    resp = api.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0, ttl_s=300))
    assert resp.status_code == 201, resp.text
    return eid


def shake(api: httpx.Client, prefill: str, decode: dict[str, Any]) -> httpx.Response:
    body = {"tp_size": 1, "rank": 0, "decode": decode}
    return api.post(f"/engines/{prefill}/handshake", json=body)


def problem(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = resp.json()
    assert body["code"] == code, body
    return body


def handshake_events(api: httpx.Client, prefill: str) -> list[dict[str, Any]]:
    resp = api.get("/events", params={"limit": 1000})
    assert resp.status_code == 200, resp.text
    return [
        e
        for e in resp.json()["events"]
        if e["kind"] == "handshake" and e["fields"].get("engine_id") == prefill
    ]


def test_a_decode_group_that_does_not_exist_is_404_naming_it(api: httpx.Client) -> None:
    prefill = ready_prefill(api)
    missing = gid("nowhere")
    body = problem(shake(api, prefill, {"group_id": missing}), 404, "not_found")
    assert body["decode_group_id"] == missing
    assert missing in body["detail"]
    assert handshake_events(api, prefill) == []


def test_a_malformed_decode_group_id_is_422(api: httpx.Client) -> None:
    prefill = ready_prefill(api)
    body = problem(shake(api, prefill, {"group_id": "../x"}), 422, "invalid_request")
    assert any(e["loc"][-2:] == ["decode", "group_id"] for e in body["errors"]), body


def test_a_prefill_group_named_as_the_decode_is_409_incompatible(api: httpx.Client) -> None:
    prefill = ready_prefill(api)
    other = gid("p2")
    other_eid = opened(api, other, "prefill")
    resp = shake(api, prefill, {"group_id": other, "engine_id": other_eid})
    body = problem(resp, 409, "incompatible")
    assert body["mismatches"] == [{"field": "decode.role", "remote": "decode", "local": "prefill"}]
    both = gid("b")
    assert shake(
        api, prefill, {"group_id": both, "engine_id": opened(api, both, "both")}
    ).is_success


@pytest.mark.parametrize("forged", ["unknown", "superseded", "other_group"])
def test_a_forged_decode_engine_id_is_409_with_its_cause(api: httpx.Client, forged: str) -> None:
    prefill = ready_prefill(api)
    decode = gid("d")
    first = opened(api, decode, "decode")
    current = opened(api, decode, "decode")  # a relaunch: ``first`` is superseded
    got = {
        "unknown": str(uuid.uuid4()),
        "superseded": first,
        "other_group": opened(api, gid("d2"), "decode"),
    }[forged]
    resp = shake(api, prefill, {"group_id": decode, "engine_id": got})
    body = problem(resp, 409, "engine_id_mismatch")
    assert body["cause"] == forged, body
    assert body["expected_engine_id"] == current
    assert body["got_engine_id"] == got


@pytest.mark.timeout(60)
def test_the_recorded_decode_is_the_verified_one(api: httpx.Client) -> None:
    prefill = ready_prefill(api)
    decode = gid("d")
    genuine = opened(api, decode, "decode")
    forged = str(uuid.uuid4())
    resp = shake(api, prefill, {"group_id": decode, "engine_id": forged})
    problem(resp, 409, "engine_id_mismatch")
    assert shake(api, prefill, {"group_id": decode, "engine_id": genuine}).is_success
    # Without an engine id the decode group's current engine is what is recorded.
    other = gid("d")
    other_eid = opened(api, other, "decode")
    assert shake(api, prefill, {"group_id": other}).is_success
    deadline = time.monotonic() + EVENT_WAIT_S
    while True:
        events = handshake_events(api, prefill)
        if len(events) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    sides = sorted(
        (e["fields"]["decode_group_id"], e["fields"]["decode_engine_id"]) for e in events
    )
    assert sides == sorted([(decode, genuine), (other, other_eid)]), events


@pytest.mark.timeout(60)
def test_a_relaunched_decode_group_is_recorded_with_its_new_engine(api: httpx.Client) -> None:
    prefill = ready_prefill(api)
    decode = gid("d")
    first = opened(api, decode, "decode")
    assert shake(api, prefill, {"group_id": decode, "engine_id": first}).is_success
    second = opened(api, decode, "decode")
    assert shake(api, prefill, {"group_id": decode, "engine_id": second}).is_success
    deadline = time.monotonic() + EVENT_WAIT_S
    while True:
        events = handshake_events(api, prefill)
        if len(events) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    recorded = sorted(e["fields"]["decode_engine_id"] for e in events)
    assert recorded == sorted([first, second]), events
