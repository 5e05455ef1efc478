"""Agents: register/replace, heartbeats, deregistration, leases, and engine_id_mismatch."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from tests.app.api.conftest import Api, agent_body, invalid, new_gid, problem

pytestmark = pytest.mark.api


def agent_url(group: str, rank: int) -> str:
    return f"/tp-groups/{group}/engine/agents/{rank}"


def heartbeat(api: httpx.Client, group: str, rank: int, engine_id: str) -> httpx.Response:
    return api.post(f"{agent_url(group, rank)}/heartbeat", json={"engine_id": engine_id})


def test_register_answers_201_then_200_when_it_replaces_the_agent(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    body = agent_body(engine["engine_id"], 1, ttl_s=45)
    first = api.put(agent_url(gid, 1), json=body)
    assert first.status_code == 201, first.text
    agent = first.json()
    assert "agent_metadata" not in agent
    assert agent["engine_id"] == engine["engine_id"]
    assert agent["generation"] == 1
    assert agent["rank"] == 1
    assert agent["agent_name"] == body["agent_name"]
    assert agent["host"] == body["host"]
    assert agent["kv"] == body["kv"]
    assert agent["ttl_s"] == 45
    assert agent["registered_at"].endswith("Z")
    assert agent["expires_at"] > agent["registered_at"]
    replaced = api.put(agent_url(gid, 1), json={**body, "agent_name": "renamed"})
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["agent_name"] == "renamed"
    assert "agent_metadata" not in replaced.json()
    view = reg.engine(gid)
    assert view["registered_ranks"] == [1]
    assert view["missing_ranks"] == [0]


def test_register_uses_a_default_ttl_of_thirty_seconds(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=1)
    body = agent_body(engine["engine_id"], 0)
    del body["ttl_s"]
    resp = api.put(agent_url(gid, 0), json=body)
    assert resp.status_code == 201, resp.text
    assert resp.json()["ttl_s"] == 30


def test_register_accepts_a_dns_name_and_ipv6_host(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register(engine, 0, host="node-3.cluster.local")
    reg.register(engine, 1, host="fd00::12")


def test_register_in_an_unknown_group_is_404(api: httpx.Client, gid: str) -> None:
    resp = api.put(agent_url(gid, 0), json=agent_body(str(uuid.uuid4()), 0))
    problem(resp, 404, "not_found")


def mismatch(resp: httpx.Response, cause: str, expected: str, got: str) -> dict[str, Any]:
    body = problem(resp, 409, "engine_id_mismatch")
    assert body["cause"] == cause
    assert body["expected_engine_id"] == expected
    assert body["got_engine_id"] == got
    return body


def test_register_with_a_superseded_engine_id_names_cause_superseded(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    old = reg.open(gid, tp_size=4)
    new = reg.open(gid, tp_size=4)
    resp = api.put(agent_url(gid, 2), json=agent_body(old["engine_id"], 2))
    body = mismatch(resp, "superseded", new["engine_id"], old["engine_id"])
    detail = body["detail"]
    for fact in (gid, "rank 2", old["engine_id"], new["engine_id"], "generation 1", "generation 2"):
        assert fact in detail, (fact, detail)


def test_register_with_another_groups_engine_id_names_cause_other_group(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    other_gid = new_gid("other")
    other = reg.open(other_gid, tp_size=2)
    mine = reg.open(gid, tp_size=2)
    resp = api.put(agent_url(gid, 1), json=agent_body(other["engine_id"], 1))
    body = mismatch(resp, "other_group", mine["engine_id"], other["engine_id"])
    detail = body["detail"]
    for fact in (gid, other_gid, "rank 1", other["engine_id"], mine["engine_id"], "generation 1"):
        assert fact in detail, (fact, detail)


def test_register_with_a_made_up_engine_id_names_cause_unknown(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    mine = reg.open(gid, tp_size=2)
    made_up = str(uuid.uuid4())
    resp = api.put(agent_url(gid, 0), json=agent_body(made_up, 0))
    body = mismatch(resp, "unknown", mine["engine_id"], made_up)
    for fact in (gid, "rank 0", made_up, mine["engine_id"], "generation 1"):
        assert fact in body["detail"], (fact, body["detail"])
    assert reg.engine(gid)["registered_ranks"] == []


def test_register_with_rank_at_or_above_tp_size_is_422(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    for rank in (2, 3, 65535):
        errors = invalid(api.put(agent_url(gid, rank), json=agent_body(engine["engine_id"], rank)))
        assert any("rank" in e["loc"] for e in errors), errors


def test_heartbeat_and_delete_with_rank_at_or_above_tp_size_are_422(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    invalid(heartbeat(api, gid, 2, engine["engine_id"]))
    invalid(api.delete(agent_url(gid, 2), params={"engine_id": engine["engine_id"]}))


@pytest.mark.parametrize("rank", ["-1", "x", "1.5", "65536"])
def test_register_with_a_malformed_rank_is_422(
    api: httpx.Client, reg: Api, gid: str, rank: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    errors = invalid(
        api.put(f"/tp-groups/{gid}/engine/agents/{rank}", json=agent_body(engine["engine_id"], 0))
    )
    assert any(e["loc"][:2] == ["path", "rank"] for e in errors), errors


BAD_AGENTS: dict[str, dict[str, Any]] = {
    "host-ipv4-unspecified": {"host": "0.0.0.0"},
    "host-ipv6-unspecified": {"host": "::"},
    "host-empty": {"host": ""},
    "host-garbage": {"host": "not a host!"},
    "blob-not-base64": {"agent_metadata": "this is *not* base64!"},
    "blob-bad-padding": {"agent_metadata": "abc"},
    "blob-empty": {"agent_metadata": ""},
    "blob-number": {"agent_metadata": 12},
    "ttl-4": {"ttl_s": 4},
    "ttl-3601": {"ttl_s": 3601},
    "ttl-string": {"ttl_s": "30"},
    "ttl-float": {"ttl_s": 30.5},
    "kv-missing-fields": {"kv": {"mem_type": "DRAM"}},
    "kv-bad-mem-type": {
        "kv": {
            "mem_type": "GPU",
            "device_id": 0,
            "base_addrs": [1],
            "num_blocks": 1,
            "block_len": 1,
        }
    },
    "kv-negative-addr": {
        "kv": {
            "mem_type": "DRAM",
            "device_id": 0,
            "base_addrs": [-1],
            "num_blocks": 1,
            "block_len": 1,
        }
    },
    "agent_name-empty": {"agent_name": ""},
    "unknown-field": {"role": "prefill"},
    "engine_id-number": {"engine_id": 5},
}


@pytest.mark.parametrize("change", list(BAD_AGENTS.values()), ids=list(BAD_AGENTS))
def test_register_with_an_invalid_body_is_422_and_registers_nothing(
    api: httpx.Client, reg: Api, gid: str, change: dict[str, Any]
) -> None:
    engine = reg.open(gid, tp_size=1)
    invalid(api.put(agent_url(gid, 0), json={**agent_body(engine["engine_id"], 0), **change}))
    assert reg.engine(gid)["registered_ranks"] == []


def test_register_with_malformed_json_is_422(api: httpx.Client, reg: Api, gid: str) -> None:
    reg.open(gid, tp_size=1)
    invalid(api.put(agent_url(gid, 0), content=b'{"engine_id": '))


def test_register_with_a_missing_engine_id_is_422(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    body = agent_body(engine["engine_id"], 0)
    del body["engine_id"]
    invalid(api.put(agent_url(gid, 0), json=body))


def test_heartbeat_renews_the_lease_and_answers_a_later_expires_at(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=1)
    agent = reg.register(engine, 0, ttl_s=30)
    time.sleep(0.05)
    first = heartbeat(api, gid, 0, engine["engine_id"])
    assert first.status_code == 200, first.text
    assert set(first.json()) == {"expires_at"}
    assert first.json()["expires_at"] > agent["expires_at"]
    time.sleep(0.05)
    second = heartbeat(api, gid, 0, engine["engine_id"])
    assert second.status_code == 200
    assert second.json()["expires_at"] > first.json()["expires_at"]


def test_heartbeat_with_a_superseded_engine_id_is_409(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    old = reg.open(gid, tp_size=1)
    reg.register(old, 0)
    new = reg.open(gid, tp_size=1)
    mismatch(
        heartbeat(api, gid, 0, old["engine_id"]), "superseded", new["engine_id"], old["engine_id"]
    )


def test_heartbeat_with_an_unknown_engine_id_is_409_unknown(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=1)
    reg.register(engine, 0)
    made_up = str(uuid.uuid4())
    mismatch(heartbeat(api, gid, 0, made_up), "unknown", engine["engine_id"], made_up)


def test_heartbeat_of_an_absent_agent_is_404(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register(engine, 0)
    problem(heartbeat(api, gid, 1, engine["engine_id"]), 404, "not_found")


def test_heartbeat_in_an_unknown_group_is_404(api: httpx.Client, gid: str) -> None:
    problem(heartbeat(api, gid, 0, str(uuid.uuid4())), 404, "not_found")


def test_heartbeat_without_engine_id_is_422(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    reg.register(engine, 0)
    invalid(api.post(f"{agent_url(gid, 0)}/heartbeat", json={}))
    invalid(api.post(f"{agent_url(gid, 0)}/heartbeat", content=b"nope"))
    invalid(
        api.post(f"{agent_url(gid, 0)}/heartbeat", json={"engine_id": engine["engine_id"], "x": 1})
    )


def test_an_expired_agent_is_absent_everywhere(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register(engine, 0, ttl_s=5)
    reg.register(engine, 1, ttl_s=3600)
    assert reg.engine(gid)["ready"] is True
    deadline = time.monotonic() + 15
    while reg.engine(gid)["ready"]:
        assert time.monotonic() < deadline, "the 5 s lease never expired"
        time.sleep(0.25)
    view = reg.engine(gid)
    assert view["registered_ranks"] == [1]
    assert view["missing_ranks"] == [0]
    problem(heartbeat(api, gid, 0, engine["engine_id"]), 404, "not_found")
    problem(
        api.delete(agent_url(gid, 0), params={"engine_id": engine["engine_id"]}), 404, "not_found"
    )
    hs = api.post(f"/engines/{engine['engine_id']}/handshake", json={"tp_size": 2, "rank": 0})
    assert problem(hs, 503, "not_ready")["missing_ranks"] == [0]
    # The worker registers again: a new agent, so 201.
    reg.register(engine, 0, expect=201)
    assert reg.engine(gid)["ready"] is True


def test_delete_agent_answers_204_and_the_rank_goes_missing(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register_all(engine)
    resp = api.delete(agent_url(gid, 1), params={"engine_id": engine["engine_id"]})
    assert resp.status_code == 204, resp.text
    assert resp.content == b""
    view = reg.engine(gid)
    assert (view["registered_ranks"], view["missing_ranks"], view["ready"]) == ([0], [1], False)
    # Gone: deleting again or heartbeating is 404; registering again is a new agent (201).
    problem(
        api.delete(agent_url(gid, 1), params={"engine_id": engine["engine_id"]}), 404, "not_found"
    )
    problem(heartbeat(api, gid, 1, engine["engine_id"]), 404, "not_found")
    reg.register(engine, 1, expect=201)


def test_delete_agent_without_engine_id_is_422(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    reg.register(engine, 0)
    errors = invalid(api.delete(agent_url(gid, 0)))
    assert any(e["loc"] == ["query", "engine_id"] for e in errors), errors
    invalid(api.delete(agent_url(gid, 0), params={"engine_id": ""}))
    assert reg.engine(gid)["registered_ranks"] == [0]


def test_delete_agent_with_a_superseded_engine_id_is_409(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    old = reg.open(gid, tp_size=1)
    new = reg.open(gid, tp_size=1)
    reg.register(new, 0)
    resp = api.delete(agent_url(gid, 0), params={"engine_id": old["engine_id"]})
    mismatch(resp, "superseded", new["engine_id"], old["engine_id"])
    assert reg.engine(gid)["registered_ranks"] == [0]


def test_delete_agent_with_another_groups_engine_id_is_409_other_group(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    other = reg.open(new_gid("other"), tp_size=1)
    mine = reg.open(gid, tp_size=1)
    reg.register(mine, 0)
    resp = api.delete(agent_url(gid, 0), params={"engine_id": other["engine_id"]})
    mismatch(resp, "other_group", mine["engine_id"], other["engine_id"])


def test_delete_agent_of_an_absent_rank_or_unknown_group_is_404(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    problem(
        api.delete(agent_url(gid, 1), params={"engine_id": engine["engine_id"]}), 404, "not_found"
    )
    problem(
        api.delete(agent_url(new_gid(), 0), params={"engine_id": engine["engine_id"]}),
        404,
        "not_found",
    )


def test_a_new_generation_removes_the_old_generations_agents(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    old = reg.open(gid, tp_size=2)
    reg.register_all(old)
    assert reg.engine(gid)["ready"] is True
    new = reg.open(gid, tp_size=2)
    view = reg.engine(gid)
    assert view["engine_id"] == new["engine_id"]
    assert (view["ready"], view["registered_ranks"], view["missing_ranks"]) == (False, [], [0, 1])
    assert new["registered_ranks"] == []
    mismatch(
        heartbeat(api, gid, 0, old["engine_id"]), "superseded", new["engine_id"], old["engine_id"]
    )
    # The new generation's ranks register as new agents.
    agent = reg.register(new, 0, expect=201)
    assert agent["generation"] == 2
