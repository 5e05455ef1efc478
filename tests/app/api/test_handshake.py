"""POST /engines/{engine_id}/handshake: heterogeneous-TP targets, compat, readiness."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.app.api.conftest import KV, Api, blob, invalid, new_gid, problem

pytestmark = pytest.mark.api

COMPAT = {"model": "llama-3-8b", "block_size": 16, "dtype": "bf16", "use_mla": True}


@pytest.fixture(scope="module")
def prefill(reg: Api) -> dict[int, dict[str, Any]]:
    """One ready prefill engine per TP size R, shared by the module's read-only tests."""
    engines = {}
    for size in (1, 2, 4, 8):
        engine = reg.open(new_gid(f"prefill-tp{size}"), tp_size=size, compat=COMPAT)
        reg.register_all(engine)
        engines[size] = engine
    return engines


def handshake(api: httpx.Client, engine_id: str, **body: Any) -> httpx.Response:
    return api.post(f"/engines/{engine_id}/handshake", json=body)


# (L, R, r) -> (tp_ratio, target ranks)
CASES = [
    (1, 1, 0, 1, [0]),
    (2, 2, 1, 1, [1]),
    (4, 4, 3, 1, [3]),
    (4, 2, 0, 2, [0]),
    (4, 2, 1, 2, [0]),
    (4, 2, 2, 2, [1]),
    (4, 2, 3, 2, [1]),
    (8, 2, 5, 4, [1]),
    (8, 1, 7, 8, [0]),
    (8, 4, 5, 2, [2]),
    (2, 4, 0, -2, [0, 1]),
    (2, 4, 1, -2, [2, 3]),
    (1, 4, 0, -4, [0, 1, 2, 3]),
    (2, 8, 1, -4, [4, 5, 6, 7]),
    (4, 8, 3, -2, [6, 7]),
    (1, 8, 0, -8, list(range(8))),
]


@pytest.mark.parametrize(("local", "remote", "rank", "ratio", "targets"), CASES)
def test_handshake_targets_follow_the_heterogeneous_tp_rule(
    api: httpx.Client,
    prefill: dict[int, dict[str, Any]],
    local: int,
    remote: int,
    rank: int,
    ratio: int,
    targets: list[int],
) -> None:
    engine = prefill[remote]
    resp = handshake(api, engine["engine_id"], tp_size=local, rank=rank, compat=COMPAT)
    assert resp.status_code == 200, resp.text
    plan = resp.json()
    assert plan["engine_id"] == engine["engine_id"]
    assert plan["group_id"] == engine["group_id"]
    assert plan["generation"] == engine["generation"]
    assert plan["remote_tp_size"] == remote
    assert plan["tp_ratio"] == ratio
    assert [t["rank"] for t in plan["targets"]] == targets


def test_handshake_targets_carry_each_ranks_blob_and_registration(
    api: httpx.Client, prefill: dict[int, dict[str, Any]]
) -> None:
    engine = prefill[4]
    eid = engine["engine_id"]
    plan = handshake(api, eid, tp_size=2, rank=1).json()
    assert [t["rank"] for t in plan["targets"]] == [2, 3]
    for target in plan["targets"]:
        rank = target["rank"]
        assert target["agent_metadata"] == blob(rank, eid)
        assert target["agent_name"] == f"{eid}-rank{rank}"
        assert target["host"] == f"10.0.0.{10 + rank}"
        assert target["kv"] == KV
        assert target["expires_at"].endswith("Z")


@pytest.mark.parametrize(
    ("local", "remote", "rank"),
    [(3, 2, 0), (3, 4, 0), (6, 4, 1), (2, 3, 1), (5, 8, 4)],
)
def test_handshake_with_sizes_that_do_not_divide_is_422(
    api: httpx.Client,
    reg: Api,
    prefill: dict[int, dict[str, Any]],
    local: int,
    remote: int,
    rank: int,
) -> None:
    if remote not in prefill:
        engine = reg.open(new_gid("odd"), tp_size=remote)
        reg.register_all(engine)
    else:
        engine = prefill[remote]
    errors = invalid(handshake(api, engine["engine_id"], tp_size=local, rank=rank))
    assert any("tp_size" in e["loc"] for e in errors), errors


@pytest.mark.parametrize(
    "body",
    [
        {"tp_size": 2, "rank": 2},
        {"tp_size": 2, "rank": 5},
        {"tp_size": 2, "rank": -1},
        {"tp_size": 0, "rank": 0},
        {"tp_size": "2", "rank": 0},
        {"tp_size": 2, "rank": 0.0},
        {"tp_size": 2, "rank": True},
        {"tp_size": 2},
        {"rank": 0},
        {"tp_size": 2, "rank": 0, "role": "decode"},
        {"tp_size": 2, "rank": 0, "compat": {"model": {"nested": 1}}},
    ],
    ids=[
        "rank-eq-size",
        "rank-above",
        "rank-negative",
        "size-zero",
        "size-string",
        "rank-float",
        "rank-bool",
        "no-rank",
        "no-size",
        "unknown-field",
        "nested-compat",
    ],
)
def test_handshake_with_an_invalid_body_is_422(
    api: httpx.Client, prefill: dict[int, dict[str, Any]], body: dict[str, Any]
) -> None:
    invalid(handshake(api, prefill[2]["engine_id"], **body))


def test_handshake_body_errors_come_before_unknown_engine(api: httpx.Client) -> None:
    invalid(handshake(api, str(uuid.uuid4()), tp_size=2, rank=2))
    invalid(api.post(f"/engines/{uuid.uuid4()}/handshake", content=b"{"))


@pytest.mark.parametrize(
    "local",
    [
        {"block_size": 16.0},
        {"block_size": 16, "dtype": "bf16", "only_decode_has_this": "x"},
        {},
        {"model": "llama-3-8b", "use_mla": True},
    ],
    ids=["16.0-equals-16", "extra-keys-ignored", "empty", "bool-equal"],
)
def test_handshake_with_compatible_compat_is_200(
    api: httpx.Client, prefill: dict[int, dict[str, Any]], local: dict[str, Any]
) -> None:
    resp = handshake(api, prefill[2]["engine_id"], tp_size=2, rank=0, compat=local)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("local", "mismatches"),
    [
        ({"block_size": "16"}, [{"field": "block_size", "remote": 16, "local": "16"}]),
        ({"use_mla": 1}, [{"field": "use_mla", "remote": True, "local": 1}]),
        ({"model": "other"}, [{"field": "model", "remote": "llama-3-8b", "local": "other"}]),
        (
            {"block_size": 32, "dtype": "fp8", "model": "llama-3-8b"},
            [
                {"field": "block_size", "remote": 16, "local": 32},
                {"field": "dtype", "remote": "bf16", "local": "fp8"},
            ],
        ),
    ],
    ids=["string-vs-number", "bool-vs-number", "value", "two-fields"],
)
def test_handshake_with_incompatible_compat_is_409_with_mismatches(
    api: httpx.Client,
    prefill: dict[int, dict[str, Any]],
    local: dict[str, Any],
    mismatches: list[dict[str, Any]],
) -> None:
    resp = handshake(api, prefill[2]["engine_id"], tp_size=2, rank=0, compat=local)
    body = problem(resp, 409, "incompatible")
    assert sorted(body["mismatches"], key=lambda m: m["field"]) == mismatches


def test_handshake_against_a_decode_engine_is_incompatible_on_role(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=1, role="decode")
    reg.register_all(engine)
    body = problem(handshake(api, engine["engine_id"], tp_size=1, rank=0), 409, "incompatible")
    assert [m["field"] for m in body["mismatches"]] == ["role"]
    assert body["mismatches"][0]["remote"] == "decode"


def test_handshake_against_a_both_engine_is_allowed(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1, role="both")
    reg.register_all(engine)
    assert handshake(api, engine["engine_id"], tp_size=1, rank=0).status_code == 200


def test_handshake_with_target_ranks_lacking_agents_is_503_not_ready(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=4, compat=COMPAT)
    reg.register_all(engine, [0, 2])
    eid = engine["engine_id"]
    # Decode TP 2, rank 1 reads prefill ranks 2 and 3; only 3 is missing.
    assert problem(handshake(api, eid, tp_size=2, rank=1), 503, "not_ready")["missing_ranks"] == [3]
    # Decode TP 1 reads all four.
    assert problem(handshake(api, eid, tp_size=1, rank=0), 503, "not_ready")["missing_ranks"] == [
        1,
        3,
    ]
    # A decode rank whose targets are all live is served although the group is not ready.
    ok = handshake(api, eid, tp_size=4, rank=2)
    assert ok.status_code == 200, ok.text
    assert [t["rank"] for t in ok.json()["targets"]] == [2]
    ok = handshake(api, eid, tp_size=8, rank=1)
    assert [t["rank"] for t in ok.json()["targets"]] == [0]


def test_handshake_checks_compat_before_readiness(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=2, compat={"model": "a"})
    resp = handshake(api, engine["engine_id"], tp_size=2, rank=0, compat={"model": "b"})
    problem(resp, 409, "incompatible")


def test_handshake_with_a_superseded_engine_is_410(api: httpx.Client, reg: Api, gid: str) -> None:
    old = reg.open(gid, tp_size=1)
    reg.register_all(old)
    new = reg.open(gid, tp_size=1)
    body = problem(handshake(api, old["engine_id"], tp_size=1, rank=0), 410, "engine_superseded")
    assert body["current_engine_id"] == new["engine_id"]
    assert body["current_generation"] == 2


def test_handshake_with_a_never_issued_engine_is_404(api: httpx.Client) -> None:
    problem(handshake(api, str(uuid.uuid4()), tp_size=1, rank=0), 404, "not_found")


def test_a_pipeline_parallel_prefill_is_planned_over_its_tp_x_pp_world(
    api: httpx.Client, reg: Api
) -> None:
    # The vLLM plugin opens a PP > 1 instance as one engine over its TP x PP world, rank
    # pp_rank * TP + tp_rank, each rank's stage in its kv (workers/vllm_plugin/worker_side.py).
    # The registry plans TP only: a decode of TP 1 gets every stage's ranks in rank order; a
    # decode of TP 2 gets contiguous rank pairs, i.e. one PP stage each, not one TP rank of
    # every stage. That is why a decode's handshake with a PP prefill goes over vLLM's side
    # channel (docs/vllm-plugin.md "Data parallel", pipeline parallelism).
    tp, pp = 2, 2
    engine = reg.open(new_gid("prefill-tp2-pp2"), tp_size=tp * pp, compat=COMPAT)
    for rank in range(tp * pp):
        reg.register(engine, rank, kv={**KV, "pp_rank": rank // tp, "tp_rank": rank % tp})
    whole = handshake(api, engine["engine_id"], tp_size=1, rank=0, compat=COMPAT)
    assert whole.status_code == 200, whole.text
    plan = whole.json()
    assert plan["remote_tp_size"] == tp * pp
    assert plan["tp_ratio"] == -(tp * pp)
    stages = [(t["kv"]["pp_rank"], t["kv"]["tp_rank"]) for t in plan["targets"]]
    assert stages == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, stage in ((0, 0), (1, 1)):
        half = handshake(api, engine["engine_id"], tp_size=2, rank=rank, compat=COMPAT).json()
        assert {t["kv"]["pp_rank"] for t in half["targets"]} == {stage}
        assert [t["kv"]["tp_rank"] for t in half["targets"]] == [0, 1]
