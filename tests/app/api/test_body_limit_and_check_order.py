"""Size (413) and the contract's check order: shape (422) before size (413) before existence
(404) before state (409). Runs against a server with a 64 KiB body limit."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import Api, agent_body, invalid, new_gid, problem, sqlite_url

pytestmark = pytest.mark.api

LIMIT = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp("small-limit")
    with RegistryProcess(
        sqlite_url(directory),
        env={"REGISTRY_MAX_BODY_BYTES": str(LIMIT)},
        log_path=directory / "registry.log",
    ) as proc:
        yield proc


def big_agent(engine_id: str, rank: int, blob_bytes: int) -> dict[str, Any]:
    return agent_body(
        engine_id, rank, agent_metadata=base64.b64encode(b"\x01" * blob_bytes).decode()
    )


def test_a_body_over_the_limit_is_413(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    resp = api.put(
        f"/tp-groups/{gid}/engine/agents/0", json=big_agent(engine["engine_id"], 0, LIMIT)
    )
    problem(resp, 413, "payload_too_large")
    assert "x-request-id" in resp.headers
    assert reg.engine(gid)["registered_ranks"] == []


def test_a_body_just_under_the_limit_is_accepted(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    body = big_agent(engine["engine_id"], 0, (LIMIT - 1024) * 3 // 4)
    assert len(httpx.Request("PUT", "http://x", json=body).content) < LIMIT
    resp = api.put(f"/tp-groups/{gid}/engine/agents/0", json=body)
    assert resp.status_code == 201, resp.text
    hs = api.post(f"/engines/{engine['engine_id']}/handshake", json={"tp_size": 1, "rank": 0})
    assert hs.json()["targets"][0]["agent_metadata"] == body["agent_metadata"]


def chunks(total: int, size: int = 8192) -> Iterator[bytes]:
    yield b'{"engine_id": "x", "agent_metadata": "'
    sent = 0
    while sent < total:
        yield b"A" * size
        sent += size
    yield b'"}'


def test_a_chunked_body_over_the_limit_without_content_length_is_413(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    reg.open(gid, tp_size=1)
    request = api.build_request(
        "PUT", f"/tp-groups/{gid}/engine/agents/0", content=chunks(4 * LIMIT)
    )
    assert "content-length" not in request.headers
    assert request.headers["transfer-encoding"] == "chunked"
    problem(api.send(request), 413, "payload_too_large")
    assert reg.engine(gid)["registered_ranks"] == []


def test_a_small_chunked_body_is_read_normally(api: httpx.Client, reg: Api, gid: str) -> None:
    engine = reg.open(gid, tp_size=1)
    raw = json.dumps(agent_body(engine["engine_id"], 0)).encode()
    resp = api.put(
        f"/tp-groups/{gid}/engine/agents/0",
        content=iter([raw[:10], raw[10:50], raw[50:]]),
    )
    assert resp.status_code == 201, resp.text


def test_an_oversized_engine_open_is_413(api: httpx.Client, gid: str) -> None:
    body = {"launch_id": "l", "tp_size": 1, "role": "prefill", "compat": {"model": "m" * LIMIT}}
    problem(api.put(f"/tp-groups/{gid}/engine", json=body), 413, "payload_too_large")
    problem(api.get(f"/tp-groups/{gid}/engine"), 404, "not_found")


def test_size_is_checked_before_existence(api: httpx.Client) -> None:
    # An unknown group (404) with a body over the limit: 413 comes first.
    unknown = new_gid("unknown")
    resp = api.put(f"/tp-groups/{unknown}/engine/agents/0", json=big_agent("e", 0, LIMIT))
    problem(resp, 413, "payload_too_large")
    resp = api.post("/engines/never-issued/handshake", content=b"x" * (LIMIT + 1))
    problem(resp, 413, "payload_too_large")


@pytest.mark.parametrize(
    "path",
    [
        "/tp-groups/BAD_GROUP/engine/agents/0",
        "/tp-groups/ok-group/engine/agents/-1",
        "/tp-groups/ok-group/engine/agents/nope",
    ],
    ids=["group-id", "negative-rank", "rank-not-int"],
)
def test_path_errors_answer_422_before_size(api: httpx.Client, path: str) -> None:
    errors = invalid(api.put(path, json=big_agent("e", 0, LIMIT)))
    assert all(e["loc"][0] == "path" for e in errors), errors


def test_oversized_chunked_body_with_a_path_error_is_still_422(api: httpx.Client) -> None:
    request = api.build_request(
        "PUT", "/tp-groups/UPPER/engine/agents/0", content=chunks(2 * LIMIT)
    )
    invalid(api.send(request))


def test_shape_is_checked_before_existence(api: httpx.Client) -> None:
    # An unknown group with a malformed body: 422, not 404.
    unknown = new_gid("unknown")
    invalid(api.put(f"/tp-groups/{unknown}/engine/agents/0", content=b"{not json"))
    invalid(api.put(f"/tp-groups/{unknown}/engine/agents/0", json={"engine_id": "e"}))
    invalid(api.post(f"/tp-groups/{unknown}/engine/agents/0/heartbeat", json={}))
    invalid(api.delete(f"/tp-groups/{unknown}/engine/agents/0"))


def test_existence_is_checked_before_state(api: httpx.Client, reg: Api, gid: str) -> None:
    # A superseded engine_id on a rank that never registered: 409 (state) for the mismatch,
    # but an absent agent of the current engine is 404.
    old = reg.open(gid, tp_size=2)
    new = reg.open(gid, tp_size=2)
    url = f"/tp-groups/{gid}/engine/agents/1/heartbeat"
    problem(api.post(url, json={"engine_id": old["engine_id"]}), 409, "engine_id_mismatch")
    problem(api.post(url, json={"engine_id": new["engine_id"]}), 404, "not_found")
