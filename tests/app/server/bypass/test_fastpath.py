"""The fast path (app/server/bypass/fastpath.py) answers exactly as FastAPI does: the same requests
to a
server with it and one without (REGISTRY_FAST_PATH=false) get the same status, error code and
answer shape."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body

pytestmark = pytest.mark.api

Step = tuple[str, str, Any]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, httpx.Client]]:
    tmp = tmp_path_factory.mktemp("fastpath")
    clients: dict[str, httpx.Client] = {}
    with (
        RegistryProcess(f"sqlite:///{tmp / 'on.db'}", log_path=tmp / "on.log") as on,
        RegistryProcess(
            f"sqlite:///{tmp / 'off.db'}",
            log_path=tmp / "off.log",
            env={"REGISTRY_FAST_PATH": "false"},
        ) as off,
    ):
        for name, server in (("on", on), ("off", off)):
            clients[name] = httpx.Client(base_url=server.url, timeout=30.0)
        yield clients
        for c in clients.values():
            c.close()


def shape(value: Any) -> Any:
    """The answer without what differs between two servers (ids, times)."""
    if isinstance(value, dict):
        return {
            k: shape(v)
            for k, v in value.items()
            if k
            not in {
                "engine_id",
                "agent_name",
                "expires_at",
                "registered_at",
                "created_at",
                "detail",
                "instance",
                "expected_engine_id",
                "current_engine_id",
            }
        }
    if isinstance(value, list):
        return [shape(v) for v in value]
    return value


def same_everywhere(servers: dict[str, httpx.Client], steps: list[Step], tmp: Path) -> None:
    answers: dict[str, list[tuple[int, Any]]] = {}
    for name, client in servers.items():
        group = f"fp-{tmp.name[-12:]}".lower().replace("_", "-")
        engine = client.put(
            f"/tp-groups/{group}/engine",
            json={"launch_id": "l1", "tp_size": 2, "role": "prefill"},
        ).json()
        eid = engine["engine_id"]
        out = []
        for method, path, body in steps:
            path = path.format(g=group, eid=eid)
            if isinstance(body, dict) and body.get("engine_id") == "{eid}":
                body = {**body, "engine_id": eid}
            if isinstance(body, (bytes, str)):
                resp = client.request(method, path, content=body)
            else:
                resp = client.request(method, path, json=body)
            payload = resp.json() if resp.content else None
            out.append((resp.status_code, shape(payload)))
        answers[name] = out
    for step, on, off in zip(steps, answers["on"], answers["off"], strict=True):
        assert on == off, f"{step}: fast path {on} != FastAPI {off}"


def test_valid_and_invalid_hot_requests_answer_alike(
    servers: dict[str, httpx.Client], tmp_path: Path
) -> None:
    agent = agent_body("{eid}", 0)
    steps: list[Step] = [
        ("GET", "/tp-groups/{g}/engine", None),
        ("PUT", "/tp-groups/{g}/engine/agents/0", agent),
        ("PUT", "/tp-groups/{g}/engine/agents/0", agent),  # replaced: 200
        ("PUT", "/tp-groups/{g}/engine/agents/5", agent),  # rank >= tp_size: 422
        ("PUT", "/tp-groups/{g}/engine/agents/\u00b2", agent),  # superscript two: 422
        ("PUT", "/tp-groups/{g}/engine/agents/\u0661", agent),  # Arabic-Indic one: 422
        ("PUT", "/tp-groups/{g}/engine/agents/0", {**agent, "engine_id": "other"}),  # 409
        ("PUT", "/tp-groups/{g}/engine/agents/0", {**agent, "ttl_s": 1}),  # 422
        ("PUT", "/tp-groups/{g}/engine/agents/0", b"{not json"),  # 422
        ("POST", "/tp-groups/{g}/engine/agents/0/heartbeat", {"engine_id": "{eid}"}),
        ("POST", "/tp-groups/{g}/engine/agents/1/heartbeat", {"engine_id": "{eid}"}),  # 404
        ("POST", "/tp-groups/{g}/engine/agents/0/heartbeat", {"engine_id": 7}),  # 422
        ("GET", "/tp-groups/{g}%0A/engine", None),  # a final newline in the id: 422
        ("GET", "/tp-groups/nobody/engine", None),  # 404
        ("POST", "/engines/{eid}/handshake", {"tp_size": 2, "rank": 1}),  # 503 not_ready
        ("POST", "/engines/{eid}/handshake", {"tp_size": 3, "rank": 0}),  # 422 tp ratio
        ("POST", "/engines/{eid}/handshake", {"tp_size": 2, "rank": 2}),  # 422 rank
        ("POST", "/engines/unknown/handshake", {"tp_size": 2, "rank": 0}),  # 404
        # Opening: the same launch again (200), a new one (201, generation 2), a launch that
        # was superseded (409), bad bodies (422).
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l2", "tp_size": 2, "role": "prefill"}),
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l2", "tp_size": 2, "role": "prefill"}),
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l1", "tp_size": 2, "role": "prefill"}),
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l3", "tp_size": 0, "role": "prefill"}),
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l3", "tp_size": 2, "role": "chef"}),
        ("PUT", "/tp-groups/{g}/engine", {"launch_id": "l3", "tp_size": 2}),
        ("PUT", "/tp-groups/{g}%0A/engine", {"launch_id": "l3", "tp_size": 2, "role": "prefill"}),
        ("PUT", "/tp-groups/{g}/engine", b"[1, 2]"),
        ("PUT", "/tp-groups/{g}/engine", None),  # no body: 422
    ]
    same_everywhere(servers, steps, tmp_path)


def test_batched_registrations_and_heartbeats_answer_alike(
    servers: dict[str, httpx.Client], tmp_path: Path
) -> None:
    """A node's batched routes (what ``BatchPublication`` sends), valid and not."""
    one, two = agent_body("{eid}", 0) | {"rank": 0}, agent_body("{eid}", 1) | {"rank": 1}
    beat = {"engine_id": "{eid}", "ranks": [0, 1]}
    steps: list[Step] = [
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat),  # no agent yet: 404
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one]}),  # 200, rank 0 created
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one, two]}),  # 0 replaced, 1 new
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one, one]}),  # a rank twice: 422
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one, two | {"ttl_s": 60}]}),  # 422
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one | {"rank": 5}]}),  # 422
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": []}),  # 422
        ("PUT", "/tp-groups/{g}/engine/agents", {"agents": [one | {"engine_id": "x"}]}),  # 409
        ("PUT", "/tp-groups/nobody/engine/agents", {"agents": [one]}),  # 404
        ("PUT", "/tp-groups/{g}/engine/agents", b"{not json"),  # 422
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat),  # 200
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat | {"ranks": [0, 0]}),  # 422
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat | {"ranks": [7]}),  # 422
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat | {"engine_id": "x"}),  # 409
        ("POST", "/tp-groups/{g}/engine/agents/heartbeat", beat | {"engine_id": 7}),  # 422
        ("POST", "/tp-groups/nobody/engine/agents/heartbeat", beat),  # 404
        ("PUT", "/tp-groups/{g}/engine/agents/heartbeat", one),  # not a rank: 422
        ("GET", "/tp-groups/{g}/engine/agents/heartbeat", None),  # 405
        ("POST", "/tp-groups/{g}/engine/agents", {"agents": [one]}),  # 405
    ]
    same_everywhere(servers, steps, tmp_path)


def test_the_fast_path_takes_the_batched_routes() -> None:
    """Matched by the fast path, not left to FastAPI's stack: what a node's leader sends at
    fleet scale (each saves at least 20% of the registry's CPU, ``bench.route_cost``)."""
    from app.api.routes import engines, tp_groups
    from app.server.bypass.fastpath import FastPath

    async def nothing(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    fast = FastPath(nothing, [*tp_groups.router.routes, *engines.router.routes], 1 << 20)
    cases = {
        ("PUT", "tp-groups/g/engine/agents"): fast.register_batch,
        ("POST", "tp-groups/g/engine/agents/heartbeat"): fast.heartbeat_batch,
        ("PUT", "tp-groups/g/engine/agents/3"): fast.register,
        ("PUT", "tp-groups/g/engine/agents/heartbeat"): None,  # FastAPI answers: 422
        ("POST", "tp-groups/g/engine/agents"): None,
        ("GET", "tp-groups/g/engine/agents/heartbeat"): None,
    }
    for (method, path), expected in cases.items():
        assert fast.match(method, path.split("/")) == expected, (method, path)


# -- the hot path (app/server/bypass/hot.py): one write on uvicorn's connection, as uvicorn would
# -------


def _raw(url: str, data: bytes, answers: int) -> list[tuple[bytes, list[bytes], bytes]]:
    """Send ``data`` on one connection; read ``answers`` answers (status line, header
    names in order, body). Bounded: 10 s for the whole exchange."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(data)
        buf = b""
        deadline = time.monotonic() + 10.0
        while len(out) < answers and time.monotonic() < deadline:
            while b"\r\n\r\n" not in buf:
                chunk = sock.recv(65536)
                assert chunk, f"connection closed after {len(out)} answers"
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            status, *lines = head.split(b"\r\n")
            names = [line.split(b":", 1)[0].lower() for line in lines]
            length = int(
                next(
                    v
                    for n, v in (ln.split(b": ", 1) for ln in lines)
                    if n.lower() == b"content-length"
                )
            )
            while len(buf) < length:
                chunk = sock.recv(65536)
                assert chunk, "connection closed mid-body"
                buf += chunk
            out.append((status, names, buf[:length]))
            buf = buf[length:]
    return out


def _group_on_both(servers: dict[str, httpx.Client], group: str) -> None:
    for client in servers.values():
        answer = client.put(
            f"/tp-groups/{group}/engine", json={"launch_id": "l1", "tp_size": 2, "role": "decode"}
        )
        assert answer.status_code == 201


def test_the_hot_path_writes_what_uvicorn_would(servers: dict[str, httpx.Client]) -> None:
    _group_on_both(servers, "hot-raw")
    get = b"GET /tp-groups/hot-raw/engine HTTP/1.1\r\nhost: x\r\n\r\n"
    close = b"GET /tp-groups/hot-raw/engine HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    seen = {}
    for name, client in servers.items():
        url = str(client.base_url).rstrip("/")
        # Two on one connection, then pipelined (both in one send), then Connection: close.
        kept = _raw(url, get, 1) + _raw(url, get + get, 2) + _raw(url, close, 1)
        assert [status for status, _, _ in kept] == [b"HTTP/1.1 200 OK"] * 4
        bodies = [json.loads(body) for _, _, body in kept]
        assert all(b["group_id"] == "hot-raw" and b["ready"] is False for b in bodies)
        seen[name] = [names for _, names, _ in kept]
    assert seen["on"] == seen["off"]
    assert seen["on"][0] == [
        b"date",
        b"server",
        b"content-length",
        b"content-type",
        b"x-request-id",
    ]
    assert seen["on"][3][-1] == b"connection"  # and the server closed it: _raw read to the end
