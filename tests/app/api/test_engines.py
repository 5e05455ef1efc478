"""PUT and GET /tp-groups/{group_id}/engine: one engine per launch, generations, readiness."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import Api, agent_body, invalid, launch, new_gid, problem

pytestmark = pytest.mark.api

ENGINE_FIELDS = {
    "group_id",
    "engine_id",
    "generation",
    "launch_id",
    "tp_size",
    "role",
    "compat",
    "created_at",
    "ready",
    "registered_ranks",
    "missing_ranks",
}


def put(api: httpx.Client, group: str, body: Any) -> httpx.Response:
    return api.put(f"/tp-groups/{group}/engine", json=body)


def test_open_with_new_launch_id_returns_201_and_a_fresh_engine(
    api: httpx.Client, gid: str
) -> None:
    body = {"launch_id": "launch-a", "tp_size": 4, "role": "prefill", "compat": {"model": "m"}}
    resp = put(api, gid, body)
    assert resp.status_code == 201, resp.text
    engine = resp.json()
    assert set(engine) >= ENGINE_FIELDS
    assert engine["group_id"] == gid
    assert str(uuid.UUID(engine["engine_id"])) == engine["engine_id"]
    assert engine["generation"] == 1
    assert engine["launch_id"] == "launch-a"
    assert engine["tp_size"] == 4
    assert engine["role"] == "prefill"
    assert engine["compat"] == {"model": "m"}
    assert engine["created_at"].endswith("Z")
    assert engine["ready"] is False
    assert engine["registered_ranks"] == []
    assert engine["missing_ranks"] == [0, 1, 2, 3]


def test_open_with_current_launch_id_returns_same_engine(api: httpx.Client, gid: str) -> None:
    body = {"launch_id": "launch-a", "tp_size": 2, "role": "both", "compat": {"model": "m"}}
    first = put(api, gid, body)
    assert first.status_code == 201
    again = put(api, gid, body)
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    # compat may be left out on a retry; that is no conflict.
    without_compat = put(api, gid, {k: v for k, v in body.items() if k != "compat"})
    assert without_compat.status_code == 200, without_compat.text
    assert without_compat.json()["engine_id"] == first.json()["engine_id"]


@pytest.mark.parametrize(
    "change",
    [
        {"tp_size": 8},
        {"role": "decode"},
        {"compat": {"model": "other"}},
        {"compat": {"model": "m", "extra": 1}},
        {"compat": {}},
    ],
    ids=["tp_size", "role", "compat-value", "compat-extra-key", "compat-empty"],
)
def test_open_with_current_launch_id_and_other_settings_is_a_group_conflict(
    api: httpx.Client, gid: str, change: dict[str, Any]
) -> None:
    body = {"launch_id": "launch-a", "tp_size": 2, "role": "prefill", "compat": {"model": "m"}}
    first = put(api, gid, body)
    assert first.status_code == 201
    problem(put(api, gid, {**body, **change}), 409, "group_conflict")
    # Nothing changed.
    assert api.get(f"/tp-groups/{gid}/engine").json() == first.json()


def test_open_with_compat_equal_by_json_number_rules_is_the_same_launch(
    api: httpx.Client, gid: str
) -> None:
    body = {"launch_id": "l", "tp_size": 1, "role": "prefill", "compat": {"block_size": 16}}
    assert put(api, gid, body).status_code == 201
    assert put(api, gid, {**body, "compat": {"block_size": 16.0}}).status_code == 200


def test_new_launch_ids_open_generations_one_two_three(reg: Api, gid: str) -> None:
    engines = [reg.open(gid) for _ in range(3)]
    assert [e["generation"] for e in engines] == [1, 2, 3]
    assert len({e["engine_id"] for e in engines}) == 3
    assert reg.engine(gid)["engine_id"] == engines[-1]["engine_id"]


def test_open_with_an_older_launch_id_is_launch_superseded(api: httpx.Client, gid: str) -> None:
    for launch_id in ("one", "two", "three"):
        assert (
            put(api, gid, {"launch_id": launch_id, "tp_size": 2, "role": "prefill"}).status_code
            == 201
        )
    for old in ("one", "two"):
        body = problem(
            put(api, gid, {"launch_id": old, "tp_size": 2, "role": "prefill"}),
            409,
            "launch_superseded",
        )
        assert body["current_generation"] == 3
        assert gid in body["detail"]
    assert api.get(f"/tp-groups/{gid}/engine").json()["generation"] == 3


@pytest.mark.parametrize(
    "group",
    ["Prefill-0", "a" * 65, "-abc", "abc-", "a_b!", "a/b%2Fc", ".abc"],
    ids=["uppercase", "too-long", "leading-dash", "trailing-dash", "bang", "slash", "leading-dot"],
)
def test_open_with_an_invalid_group_id_is_422(api: httpx.Client, group: str) -> None:
    resp = api.put(
        f"/tp-groups/{group}/engine", json={"launch_id": "x", "tp_size": 1, "role": "prefill"}
    )
    if resp.status_code == 404:  # a raw slash makes it another (unknown) path
        problem(resp, 404, "not_found")
        return
    errors = invalid(resp)
    assert any(e["loc"][:2] == ["path", "group_id"] for e in errors), errors


@pytest.mark.parametrize("group", ["a", "0", "a" * 64, "a.b_c-d", "9-z"])
def test_open_with_boundary_valid_group_ids_is_201(api: httpx.Client, group: str) -> None:
    resp = api.put(
        f"/tp-groups/{group}/engine",
        json={"launch_id": launch(), "tp_size": 1, "role": "prefill"},
    )
    assert resp.status_code in {200, 201}, resp.text
    assert resp.json()["group_id"] == group


BAD_BODIES: dict[str, Any] = {
    "tp_size-string": {"tp_size": "4"},
    "tp_size-float": {"tp_size": 4.5},
    "tp_size-bool": {"tp_size": True},
    "tp_size-zero": {"tp_size": 0},
    "tp_size-negative": {"tp_size": -2},
    "tp_size-null": {"tp_size": None},
    "role-unknown": {"role": "encode"},
    "role-number": {"role": 1},
    "launch_id-number": {"launch_id": 7},
    "launch_id-empty": {"launch_id": ""},
    "compat-nested-object": {"compat": {"model": {"name": "m"}}},
    "compat-list-value": {"compat": {"model": ["m"]}},
    "compat-null-value": {"compat": {"model": None}},
    "compat-33-keys": {"compat": {f"k{i}": i for i in range(33)}},
    "compat-not-object": {"compat": ["model"]},
    "unknown-field": {"engine_id": "mine"},
}


@pytest.mark.parametrize("change", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
def test_open_with_a_wrongly_typed_body_is_422_and_opens_nothing(
    api: httpx.Client, gid: str, change: dict[str, Any]
) -> None:
    body = {"launch_id": "l", "tp_size": 4, "role": "prefill", **change}
    invalid(put(api, gid, body))
    problem(api.get(f"/tp-groups/{gid}/engine"), 404, "not_found")


@pytest.mark.parametrize("missing", ["launch_id", "tp_size", "role"])
def test_open_without_a_required_field_is_422(api: httpx.Client, gid: str, missing: str) -> None:
    body = {"launch_id": "l", "tp_size": 4, "role": "prefill"}
    del body[missing]
    errors = invalid(put(api, gid, body))
    assert any(missing in e["loc"] for e in errors), errors


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_open_with_a_non_finite_compat_number_is_422(
    api: httpx.Client, gid: str, literal: str
) -> None:
    raw = '{"launch_id": "l", "tp_size": 1, "role": "prefill", "compat": {"x": ' + literal + "}}"
    invalid(
        api.put(
            f"/tp-groups/{gid}/engine",
            content=raw.encode(),
            headers={"content-type": "application/json"},
        )
    )


def test_open_with_thirty_two_compat_keys_is_accepted(reg: Api, gid: str) -> None:
    compat = {f"k{i}": i for i in range(32)}
    assert reg.open(gid, compat=compat)["compat"] == compat


@pytest.mark.parametrize(
    "raw",
    [b"{bad json", b"", b"[]", b'"text"', b"null", b'{"launch_id": "l",}', b"\xff\xfe"],
    ids=["truncated", "empty", "array", "string", "null", "trailing-comma", "not-utf8"],
)
def test_open_with_malformed_json_is_422_never_400(api: httpx.Client, gid: str, raw: bytes) -> None:
    for content_type in ("application/json", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        resp = api.put(f"/tp-groups/{gid}/engine", content=raw, headers=headers)
        invalid(resp)


def test_a_body_with_an_integer_past_pythons_digit_limit_is_422_never_400(
    api: httpx.Client, gid: str
) -> None:
    # json.loads refuses integers of more than 4300 digits with a ValueError, not a
    # JSONDecodeError; the answer must still be 422 invalid_request.
    huge = "9" * 5000
    bodies = {
        f"/tp-groups/{gid}/engine": '{"launch_id": "l", "tp_size": %s, "role": "prefill"}',
        f"/tp-groups/{gid}/engine/agents/0": '{"engine_id": "e", "ttl_s": %s}',
        f"/tp-groups/{gid}/engine/agents/0/heartbeat": '{"engine_id": %s}',
        "/engines/e/handshake": '{"tp_size": 1, "rank": %s}',
    }
    for path, template in bodies.items():
        raw = (template % huge).encode()
        method = "POST" if path.endswith(("heartbeat", "handshake")) else "PUT"
        errors = invalid(api.request(method, path, content=raw))
        assert errors[0]["loc"][0] == "body", errors


def test_get_engine_of_an_unknown_group_is_404(api: httpx.Client, gid: str) -> None:
    body = problem(api.get(f"/tp-groups/{gid}/engine"), 404, "not_found")
    assert gid in body["detail"]


def test_get_engine_reports_registered_and_missing_ranks_until_ready(reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=3)
    reg.register(engine, 1)
    view = reg.engine(gid)
    assert (view["ready"], view["registered_ranks"], view["missing_ranks"]) == (False, [1], [0, 2])
    reg.register(engine, 0)
    reg.register(engine, 2)
    view = reg.engine(gid)
    assert (view["ready"], view["registered_ranks"], view["missing_ranks"]) == (True, [0, 1, 2], [])
    assert view["engine_id"] == engine["engine_id"]


def test_wait_ready_returns_early_once_the_last_rank_registers(
    api: httpx.Client, server: RegistryProcess, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register(engine, 0)
    errors: list[BaseException] = []

    def register_last() -> None:
        try:
            time.sleep(0.5)
            with httpx.Client(base_url=server.url, timeout=10) as other:
                resp = other.put(
                    f"/tp-groups/{gid}/engine/agents/1", json=agent_body(engine["engine_id"], 1)
                )
                assert resp.status_code == 201, resp.text
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=register_last)
    started = time.monotonic()
    worker.start()
    resp = api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 20})
    elapsed = time.monotonic() - started
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert not errors, errors
    assert resp.status_code == 200, resp.text
    assert resp.json()["ready"] is True
    assert resp.json()["missing_ranks"] == []
    assert 0.4 < elapsed < 5, elapsed


def test_wait_ready_answers_not_ready_after_the_wait(reg: Api, api: httpx.Client, gid: str) -> None:
    reg.open(gid, tp_size=2)
    started = time.monotonic()
    resp = api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 1.5})
    elapsed = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    assert resp.json()["ready"] is False
    assert resp.json()["missing_ranks"] == [0, 1]
    assert 1.4 <= elapsed < 4.5, elapsed


def test_wait_ready_on_a_ready_engine_answers_at_once(
    reg: Api, api: httpx.Client, gid: str
) -> None:
    engine = reg.open(gid, tp_size=1)
    reg.register(engine, 0)
    started = time.monotonic()
    resp = api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 60})
    assert resp.status_code == 200
    assert resp.json()["ready"] is True
    assert time.monotonic() - started < 2


def test_wait_ready_zero_answers_at_once(reg: Api, api: httpx.Client, gid: str) -> None:
    reg.open(gid, tp_size=1)
    started = time.monotonic()
    resp = api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 0})
    assert resp.status_code == 200
    assert resp.json()["ready"] is False
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("value", ["-1", "60.5", "61", "abc", "nan", "inf", ""])
def test_wait_ready_outside_zero_to_sixty_is_422(
    reg: Api, api: httpx.Client, gid: str, value: str
) -> None:
    reg.open(gid, tp_size=1)
    errors = invalid(api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": value}))
    assert any(e["loc"] == ["query", "wait_ready"] for e in errors), errors


def test_wait_ready_on_an_unknown_group_is_404_without_waiting(api: httpx.Client, gid: str) -> None:
    started = time.monotonic()
    problem(api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 10}), 404, "not_found")
    assert time.monotonic() - started < 2
    # The query's shape is checked before the group's existence.
    invalid(api.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 61}))


def test_engine_answers_are_json_not_problems(api: httpx.Client, gid: str) -> None:
    resp = put(api, gid, {"launch_id": "l", "tp_size": 1, "role": "decode"})
    assert resp.status_code == 201
    assert resp.headers["content-type"].startswith("application/json")
    assert json.loads(resp.content)["role"] == "decode"


def test_each_group_has_its_own_generations(reg: Api) -> None:
    a, b = new_gid(), new_gid()
    assert reg.open(a)["generation"] == 1
    assert reg.open(a)["generation"] == 2
    assert reg.open(b)["generation"] == 1
