"""``GET /keepalive``: a node's renewals over one WebSocket, against a real registry process.

Renewals over the stream keep a lease past its ttl and answer what the REST batch heartbeat
answers (409 for a superseded engine, 404 for a rank without an agent, 422 for a malformed
message); the upgrade takes a worker token, a scoped token renews only its groups, a revoked
token's stream ends within a second; the limits hold (streams per replica, idle close, 404
when off) and a held stream outlives the server's request timers.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, new_gid, sqlite_url
from tests.support.streams import renew_pipelined

PATH = "/keepalive"

pytestmark = [pytest.mark.api, pytest.mark.timeout(120)]

WORKER = "ka-worker-token-5b1d0e7c"
READER = "ka-reader-token-8e2a61f0"
SCOPED = "ka-scoped-token-c4f9a3d2"
GONE = "ka-revoked-token-07b3e9a1"
WRONG = "ka-wrong-token-000000000"
SCOPE = "ka-mine-*"
TOKENS = [
    f"worker:{WORKER}",
    f"reader:{READER}",
    f"worker:{SCOPED}:name=node-a:groups={SCOPE}",
    f"worker:{GONE}:name=leaving",
]


def write_tokens(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")
    past = time.time() - 5  # held still: SIGHUP reloads it at once (app/security/tokens.py)
    os.utime(path, (past, past))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp("keepalive")
    write_tokens(directory / "tokens", TOKENS)
    with RegistryProcess(
        sqlite_url(directory),
        args=["--tokens-file", str(directory / "tokens")],
        log_path=directory / "registry.log",
    ) as proc:
        yield proc


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stream(server: RegistryProcess, token: str | None = WORKER) -> ClientConnection:
    url = server.url.replace("http://", "ws://") + PATH
    headers = bearer(token) if token else {}
    return connect(  # as the lease keeper: no compression (a compressed frame is the route's)
        url,
        additional_headers=headers,
        open_timeout=5,
        proxy=None,
        legacy=True,
        compression=None,
    )


def refused(server: RegistryProcess, token: str | None) -> dict[str, Any]:
    with pytest.raises(InvalidStatus) as caught:
        stream(server, token)
    body: dict[str, Any] = json.loads(caught.value.response.body or b"{}")
    assert body["status"] == caught.value.response.status_code, body
    return body


def renew(ws: ClientConnection, group: str, engine_id: str, ranks: list[int]) -> dict[str, Any]:
    ws.send(json.dumps([group, engine_id, ranks]))
    answer: dict[str, Any] = json.loads(ws.recv(timeout=10))
    return answer


def launch_batch(
    api: httpx.Client, group: str, ranks: int = 2, ttl_s: int = 600, token: str = WORKER
) -> str:
    opened = api.put(
        f"/tp-groups/{group}/engine",
        json={"launch_id": uuid.uuid4().hex, "tp_size": ranks, "role": "prefill"},
        headers=bearer(token),
    )
    assert opened.status_code in (200, 201), opened.text
    engine_id: str = opened.json()["engine_id"]
    items = [agent_body(engine_id, r, ttl_s=ttl_s) | {"rank": r} for r in range(ranks)]
    put = api.put(
        f"/tp-groups/{group}/engine/agents", json={"agents": items}, headers=bearer(token)
    )
    assert put.status_code == 200, put.text
    return engine_id


def live_ranks(api: httpx.Client, group: str) -> list[int]:
    got = api.get(f"/tp-groups/{group}/engine", headers=bearer(READER))
    assert got.status_code == 200, got.text
    return sorted(a["rank"] for a in got.json()["agents"])


@pytest.fixture(scope="module")
def api(server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        yield client


def test_renewals_over_the_stream_keep_a_lease_alive_past_its_ttl(
    server: RegistryProcess, api: httpx.Client
) -> None:
    kept, left = new_gid("ka"), new_gid("ka")
    kept_id = launch_batch(api, kept, ttl_s=5)
    launch_batch(api, left, ttl_s=5)  # the control: the same lease, never renewed
    with stream(server) as ws:
        started = time.monotonic()
        while time.monotonic() - started < 8:  # past the ttl (5 s) by 3 s
            answer = renew(ws, kept, kept_id, [0, 1])
            assert [a["rank"] for a in answer["agents"]] == [0, 1], answer
            time.sleep(1.5)
        assert live_ranks(api, kept) == [0, 1]
    assert live_ranks(api, left) == []


def test_a_superseded_or_unknown_renewal_answers_as_the_rest_heartbeat_does(
    server: RegistryProcess, api: httpx.Client
) -> None:
    group = new_gid("ka")
    old = launch_batch(api, group)
    new = launch_batch(api, group)  # a newer launch supersedes the first
    assert new != old
    with stream(server) as ws:
        answer = renew(ws, group, old, [0, 1])
        rest = api.post(
            f"/tp-groups/{group}/engine/agents/heartbeat",
            json={"engine_id": old, "ranks": [0, 1]},
            headers=bearer(WORKER),
        )
        assert answer["status"] == rest.status_code == 409, answer
        assert answer["code"] == rest.json()["code"] == "engine_id_mismatch"
        assert answer["instance"] == f"/tp-groups/{group}/engine/agents/heartbeat"
        assert renew(ws, new_gid("ka"), new, [0])["status"] == 404  # no such group
        assert renew(ws, group, new, [0, 1])["agents"][1]["rank"] == 1  # the stream goes on
        for bad in ('"x"', "[1, 2]", '["Not A Group", "e", [0]]', json.dumps([group, new, []])):
            ws.send(bad)
            answer = json.loads(ws.recv(timeout=10))
            assert (answer["status"], answer["code"]) == (422, "invalid_request"), (bad, answer)


def test_the_upgrade_takes_a_worker_token_and_a_scoped_one_renews_only_its_groups(
    server: RegistryProcess, api: httpx.Client
) -> None:
    assert refused(server, None)["code"] == "unauthorized"
    assert refused(server, WRONG)["code"] == "unauthorized"
    assert refused(server, READER)["code"] == "forbidden"
    mine, other = new_gid("ka-mine"), new_gid("ka")
    mine_id = launch_batch(api, mine, token=SCOPED)
    other_id = launch_batch(api, other)
    with stream(server, SCOPED) as ws:
        assert [a["rank"] for a in renew(ws, mine, mine_id, [0, 1])["agents"]] == [0, 1]
        answer = renew(ws, other, other_id, [0, 1])
        assert (answer["status"], answer["code"]) == (403, "out_of_scope"), answer
        assert answer["group_id"] == other


def test_a_revoked_token_ends_its_streams_within_a_second(
    server: RegistryProcess, api: httpx.Client, tmp_path: Path
) -> None:
    group = new_gid("ka")
    engine_id = launch_batch(api, group)
    tokens = Path(server.args[server.args.index("--tokens-file") + 1])
    with stream(server, GONE) as gone, stream(server, WORKER) as kept:
        assert renew(gone, group, engine_id, [0])["agents"]
        write_tokens(tokens, [t for t in TOKENS if GONE not in t])
        assert server.proc is not None
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGHUP)
        last = json.loads(gone.recv(timeout=5))
        assert (last["status"], last["code"]) == (401, "unauthorized"), last
        with pytest.raises(ConnectionClosed) as closed:
            gone.recv(timeout=5)
        assert time.monotonic() - sent < 1.0
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1008
        assert renew(kept, group, engine_id, [0, 1])["agents"]  # other tokens' streams stay
    assert refused(server, GONE)["code"] == "unauthorized"
    write_tokens(tokens, TOKENS)
    server.proc.send_signal(signal.SIGHUP)


def test_limits_idle_close_and_a_stream_outlives_the_request_timers(tmp_path: Path) -> None:
    env = {
        "REGISTRY_KEEPALIVE_MAX": "1",
        "REGISTRY_KEEPALIVE_IDLE_S": "2",
        "REGISTRY_BODY_TIMEOUT_S": "1",
        "REGISTRY_HEADER_TIMEOUT_S": "1",
    }
    with (
        RegistryProcess(sqlite_url(tmp_path), env=env, log_path=tmp_path / "log") as server,
        httpx.Client(base_url=server.url, timeout=30.0) as api,
    ):
        group = new_gid("ka")
        engine_id = launch_batch(api, group)
        with stream(server, None) as ws:
            full = refused(server, None)  # one stream per replica here
            assert (full["status"], full["code"]) == (503, "overloaded"), full
            for _ in range(4):  # 3.2 s: past the body and header timers (1 s)
                assert renew(ws, group, engine_id, [0, 1])["agents"]
                time.sleep(0.8)
            quiet = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert 1.0 < time.monotonic() - quiet < 4.0
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1000
        with stream(server, None) as again:  # the slot is free again
            assert renew(again, group, engine_id, [0])["agents"]
    with RegistryProcess(sqlite_url(tmp_path / "off"), env={"REGISTRY_KEEPALIVE_MAX": "0"}) as off:
        assert refused(off, None)["code"] == "not_found"


def test_pings_and_a_fragmented_message_are_answered_in_order(
    server: RegistryProcess, api: httpx.Client
) -> None:
    """The protocol reads whole text frames itself; a ping goes to uvicorn's protocol and a
    fragmented message hands the stream back to the route's loop, which answers the same."""
    group = new_gid("ka")
    engine_id = launch_batch(api, group)
    with stream(server) as ws:
        assert renew(ws, group, engine_id, [0])["agents"]
        assert ws.ping().wait(timeout=5)
        assert renew(ws, group, engine_id, [1])["agents"][0]["rank"] == 1
        message = json.dumps([group, engine_id, [0, 1]])
        ws.send(iter([message[:10], message[10:]]))  # two frames, one message
        assert [a["rank"] for a in json.loads(ws.recv(timeout=10))["agents"]] == [0, 1]
        assert ws.ping().wait(timeout=5)
        assert renew(ws, group, "superseded-id", [0])["status"] == 409


def test_pipelined_renewals_are_answered_in_order_each_once(
    server: RegistryProcess, api: httpx.Client
) -> None:
    """Renewals sent back to back (read in one go, some waiting on the store's commit right
    after the registration) are answered one each, in order, a refused one in its place."""
    group = new_gid("ka")
    engine_id = launch_batch(api, group)
    with stream(server) as ws:
        renew_pipelined(ws, group, engine_id, [[0], [1], [0, 1], None, [1], [0]])
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.5)  # nothing more


def test_an_upgrade_is_one_access_line_and_one_count_and_no_per_connection_lines(
    tmp_path: Path,
) -> None:
    """A stream's upgrade is a request: one access line (101, or the refusal's status) with
    its request id, which the 101 carries, counted by route. uvicorn's and websockets' own
    lines a stream ("connection open", "[accepted]", "connection closed") are not written."""
    write_tokens(tmp_path / "tokens", TOKENS)
    log = tmp_path / "log"
    rid = f"ka-upgrade-{uuid.uuid4().hex[:12]}"
    with RegistryProcess(
        sqlite_url(tmp_path),
        args=["--tokens-file", str(tmp_path / "tokens")],
        env={"REGISTRY_ACCESS_LOG_RATE": "0"},  # every line: none left to the budget
        log_path=log,
    ) as server:
        url = server.url.replace("http://", "ws://") + PATH
        headers = bearer(WORKER) | {"X-Request-ID": rid}
        with connect(url, additional_headers=headers, open_timeout=5, proxy=None) as ws:
            assert ws.response.headers["X-Request-ID"] == rid
        assert refused(server, WRONG)["status"] == 401
        metrics = httpx.get(f"{server.url}/metrics", headers=bearer(READER), timeout=10).text
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    upgrades = [(e["status"], e["route"], e["method"]) for e in lines if e.get("path") == PATH]
    assert upgrades == [(101, PATH, "GET"), (401, "unmatched", "GET")], upgrades
    assert [e["request_id"] for e in lines if e.get("status") == 101] == [rid]
    counted = f'registry_http_requests_total{{method="GET",route="{PATH}",status="101"}} 1.0'
    assert counted in metrics.splitlines()
    stray = [e["msg"] for e in lines if "WebSocket" in e["msg"] or "connection " in e["msg"]]
    assert stray == [], stray


def test_at_debug_the_per_connection_lines_come_back(tmp_path: Path) -> None:
    log = tmp_path / "log"
    env = {"REGISTRY_LOG_LEVEL": "debug"}
    with (
        RegistryProcess(sqlite_url(tmp_path), env=env, log_path=log) as server,
        stream(server, None) as ws,
    ):
        ws.ping().wait(timeout=10)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    said = [e["msg"] for e in lines if e["logger"] == "uvicorn.error.websocket"]
    assert "connection open" in said, said
    assert any(m.endswith(f'"WebSocket {PATH}" [accepted]') for m in said), said
