"""Batches: the ranks of a node registered in one request and one transaction (one shared
lease), and renewed by one heartbeat. docs/api.md, "Batches"."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.app.api.conftest import Api, agent_body, invalid, problem

pytestmark = pytest.mark.api


def items(engine: dict[str, Any], ranks: list[int], **overrides: Any) -> dict[str, Any]:
    return {
        "agents": [{"rank": r, **agent_body(engine["engine_id"], r, **overrides)} for r in ranks]
    }


def put_batch(api: httpx.Client, group: str, body: dict[str, Any]) -> httpx.Response:
    return api.put(f"/tp-groups/{group}/engine/agents", json=body)


def test_a_batch_registers_every_rank_in_one_request(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=4)
    resp = put_batch(api, gid, items(engine, [0, 1, 2, 3]))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [a["rank"] for a in body["agents"]] == [0, 1, 2, 3]
    assert body["created_ranks"] == [0, 1, 2, 3]
    assert body["replaced_ranks"] == []
    assert all("agent_metadata" not in a for a in body["agents"])
    assert len({a["expires_at"] for a in body["agents"]}) == 1  # one lease
    assert reg.engine(gid)["ready"] is True


def test_a_batch_with_one_bad_rank_registers_none_and_names_it(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4)
    body = items(engine, [0, 1, 2])
    body["agents"][2]["engine_id"] = "never-issued-by-this-registry"
    mismatch = problem(put_batch(api, gid, body), 409, "engine_id_mismatch")
    assert mismatch["rank"] == 2
    assert mismatch["cause"] == "unknown"
    assert reg.engine(gid)["registered_ranks"] == []

    errors = invalid(put_batch(api, gid, items(engine, [0, 7])))
    assert errors[0]["loc"] == ["body", "agents", 1, "rank"]
    assert reg.engine(gid)["registered_ranks"] == []


def test_a_batch_refuses_a_repeated_rank_and_mixed_ttls(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4)
    invalid(put_batch(api, gid, items(engine, [1, 1])))
    body = items(engine, [0, 1])
    body["agents"][1]["ttl_s"] = 60
    invalid(put_batch(api, gid, body))
    invalid(put_batch(api, gid, {"agents": []}))
    assert reg.engine(gid)["registered_ranks"] == []


def test_a_batch_again_replaces_and_reports_which_ranks(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4)
    reg.register(engine, 1)
    resp = put_batch(api, gid, items(engine, [0, 1]))
    assert resp.status_code == 200, resp.text
    assert resp.json()["created_ranks"] == [0]
    assert resp.json()["replaced_ranks"] == [1]


def test_ranks_sharing_a_lease_survive_another_ranks_replacement_and_deregistration(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4)
    assert put_batch(api, gid, items(engine, [0, 1, 2])).status_code == 200
    reg.register(engine, 0, expect=200)  # rank 0 alone: its own lease now
    gone = api.delete(
        f"/tp-groups/{gid}/engine/agents/1", params={"engine_id": engine["engine_id"]}
    )
    assert gone.status_code == 204
    assert reg.engine(gid)["registered_ranks"] == [0, 2]


def test_one_heartbeat_renews_every_rank_of_a_batch(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=2)
    first = put_batch(api, gid, items(engine, [0, 1], ttl_s=5)).json()["agents"][0]["expires_at"]
    time.sleep(0.05)
    resp = api.post(
        f"/tp-groups/{gid}/engine/agents/heartbeat",
        json={"engine_id": engine["engine_id"], "ranks": [0, 1]},
    )
    assert resp.status_code == 200, resp.text
    renewed = resp.json()["agents"]
    assert [a["rank"] for a in renewed] == [0, 1]
    assert all(a["expires_at"] > first for a in renewed)


def test_a_batch_heartbeat_names_the_absent_rank_and_the_mismatch(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4)
    put_batch(api, gid, items(engine, [0, 1]))
    url = f"/tp-groups/{gid}/engine/agents/heartbeat"
    absent = problem(
        api.post(url, json={"engine_id": engine["engine_id"], "ranks": [0, 3]}), 404, "not_found"
    )
    assert "rank 3" in absent["detail"]
    other = problem(
        api.post(url, json={"engine_id": "someone-else", "ranks": [0]}), 409, "engine_id_mismatch"
    )
    assert other["cause"] == "unknown"
    invalid(api.post(url, json={"engine_id": engine["engine_id"], "ranks": [9]}))


def test_batches_are_in_the_openapi_description(api: httpx.Client) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert "put" in paths["/tp-groups/{group_id}/engine/agents"]
    assert "post" in paths["/tp-groups/{group_id}/engine/agents/heartbeat"]
