"""The hot routes answered in the connection's protocol (app/server/bypass/wire.py): in order with
the requests uvicorn answers on the same connection, handing what the fast path does not answer
to the full stack with its body already read, and under the same body deadline. Each runs with
the fast path on and off (the control): the same answers."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body
from tests.app.server.bypass.test_fastpath import _raw
from tests.support.hostile import FAST_PATHS, path_env

pytestmark = pytest.mark.api

BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module", params=FAST_PATHS)
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RegistryProcess]:
    tmp = tmp_path_factory.mktemp("wire")
    env = path_env(
        request.param, REGISTRY_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S), REGISTRY_HEADER_TIMEOUT_S="5"
    )
    with RegistryProcess(f"sqlite:///{tmp / 'r.db'}", log_path=tmp / "r.log", env=env) as proc:
        yield proc


def _request(method: str, path: str, body: object = None, raw: bytes | None = None) -> bytes:
    data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(data)}\r\n\r\n".encode() + data


def _group(url: str, group: str) -> str:
    with httpx.Client(base_url=url, timeout=10.0) as client:
        opened = client.put(
            f"/tp-groups/{group}/engine", json={"launch_id": "l1", "tp_size": 2, "role": "decode"}
        )
        assert opened.status_code == 201, opened.text
        eid: str = opened.json()["engine_id"]
        agents = [agent_body(eid, r) | {"rank": r} for r in range(2)]
        put = client.put(f"/tp-groups/{group}/engine/agents", json={"agents": agents})
        assert put.status_code == 200, put.text
    return eid


def test_hot_and_cold_requests_pipelined_on_one_connection_answer_in_order(
    server: RegistryProcess,
) -> None:
    """In one send: a cold request, a node heartbeat, a registration whose body does not
    validate (the fast path hands it to FastAPI: 422), a lookup, a heartbeat of another
    engine (409), and the heartbeat again: six answers, in the order asked."""
    eid = _group(server.url, "wire-order")
    beat, other = {"engine_id": eid, "ranks": [0, 1]}, {"engine_id": "x"}
    data = b"".join(
        [
            _request("GET", "/healthz"),
            _request("POST", "/tp-groups/wire-order/engine/agents/heartbeat", beat),
            _request("PUT", "/tp-groups/wire-order/engine/agents/0", raw=b"{not json"),
            _request("GET", "/tp-groups/wire-order/engine"),
            _request("POST", "/tp-groups/wire-order/engine/agents/heartbeat", beat | other),
            _request("POST", "/tp-groups/wire-order/engine/agents/heartbeat", beat),
        ]
    )
    answers = _raw(server.url, data, 6)
    statuses = [status.split(b" ")[1] for status, _, _ in answers]
    assert statuses == [b"200", b"200", b"422", b"200", b"409", b"200"], statuses
    assert all(b"x-request-id" in names for _, names, _ in answers)
    bodies = [json.loads(body) for _, _, body in answers]
    assert [a["rank"] for a in bodies[1]["agents"]] == [0, 1]
    assert bodies[2]["code"] == "invalid_request"
    assert bodies[3]["ready"] is True
    assert bodies[4]["code"] == "engine_id_mismatch"
    assert bodies[5]["agents"][1]["expires_at"] >= bodies[1]["agents"][1]["expires_at"]


def test_a_hot_request_whose_body_stalls_is_refused_408(server: RegistryProcess) -> None:
    eid = _group(server.url, "wire-slow")
    whole = _request(
        "POST", "/tp-groups/wire-slow/engine/agents/heartbeat", {"engine_id": eid, "ranks": [0]}
    )
    with socket.create_connection((server.host, server.port), timeout=10.0) as sock:
        sock.sendall(whole[:-5])  # the head and most of the body, never the rest
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["code"] == "request_timeout"
    assert BODY_TIMEOUT_S - 0.5 <= waited <= 3 * BODY_TIMEOUT_S + 1, waited


def test_a_client_gone_mid_answer_leaves_the_server_serving(server: RegistryProcess) -> None:
    """Twenty connections each send a heartbeat and close at once; the server writes no
    answer to a closed connection, logs no error, and answers the next client."""
    eid = _group(server.url, "wire-gone")
    beat = _request(
        "POST", "/tp-groups/wire-gone/engine/agents/heartbeat", {"engine_id": eid, "ranks": [0, 1]}
    )
    for _ in range(20):
        with socket.create_connection((server.host, server.port), timeout=10.0) as sock:
            sock.sendall(beat)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
    answers = _raw(server.url, beat, 1)
    assert answers[0][0] == b"HTTP/1.1 200 OK"
    log = server.log_path.read_text() if server.log_path else ""
    assert '"level": "error"' not in log, log[-2000:]
