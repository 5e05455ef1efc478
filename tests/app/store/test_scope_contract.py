"""The scope rows of the contract (docs/security.md "Scoped tokens"), through a real registry
process on SQLite and on etcd: a worker token with ``groups=`` writes only the groups its
patterns match (open, relaunch, register, batch register, heartbeats, serving, deregister),
is refused elsewhere with 403 ``out_of_scope`` naming the group, the token's name and scope
(never the token), and a decode's handshake may name only a decode group in its scope. An
unscoped worker token keeps writing every group; events name the token that caused them."""

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

READER = "reader-" + uuid.uuid4().hex
SHARED = "worker-shared-" + uuid.uuid4().hex
NODE7 = "worker-node7-" + uuid.uuid4().hex
ADMIN = "admin-" + uuid.uuid4().hex
SCOPE = ["p7-*", "d7-*", "exact-7"]


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp(f"scope-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{directory / 'registry.db'}"
    elif not etcd_available():
        pytest.skip(SKIP_REASON)
    else:
        url = shared_etcd().url(f"scope-{uuid.uuid4().hex}")
    tokens = directory / "tokens"
    tokens.write_text(
        f"reader:{READER}\n"
        f"worker:{SHARED}\n"  # an older line: unscoped, called by its line
        f"worker:{NODE7}:name=node-7:groups={','.join(SCOPE)}\n"
        f"admin:{ADMIN}:name=ops\n"
    )
    args = ["--tokens-file", str(tokens), "--no-access-log", "--events-keep", "200"]
    with RegistryProcess(url, args=args, log_path=directory / "registry.log") as proc:
        yield proc


def client(server: RegistryProcess, token: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=server.url, timeout=30.0, headers=headers)


@pytest.fixture(scope="module")
def node7(server: RegistryProcess) -> Iterator[httpx.Client]:
    with client(server, NODE7) as c:
        yield c


@pytest.fixture(scope="module")
def shared(server: RegistryProcess) -> Iterator[httpx.Client]:
    with client(server, SHARED) as c:
        yield c


def gid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code in (200, 201, 204), resp.text
    return resp.json() if resp.content else {}


def out_of_scope(resp: httpx.Response, group: str) -> None:
    assert resp.status_code == 403, resp.text
    body = resp.json()
    assert body["code"] == "out_of_scope", body
    assert (body["group_id"], body["token_name"], body["scope"]) == (group, "node-7", SCOPE)
    assert all(part in body["detail"] for part in (group, "node-7", "p7-*"))
    assert NODE7 not in resp.text


def batch(engine_id: str, *ranks: int) -> dict[str, Any]:
    return {"agents": [{**agent_body(engine_id, r), "rank": r} for r in ranks]}


def every_write(c: httpx.Client, group: str, engine_id: str) -> list[httpx.Response]:
    """One request of each write route a worker sends, against ``group``."""
    base = f"/tp-groups/{group}/engine"
    serving = {"engine_id": engine_id, "url": "http://10.7.0.1:8000", "model": "m"}
    return [
        c.put(base, json=open_body(tp_size=2)),  # a relaunch (a new launch_id)
        c.put(f"{base}/agents/0", json=agent_body(engine_id, 0)),
        c.put(f"{base}/agents", json=batch(engine_id, 1)),
        c.post(f"{base}/agents/0/heartbeat", json={"engine_id": engine_id}),
        c.post(f"{base}/agents/heartbeat", json={"engine_id": engine_id, "ranks": [0, 1]}),
        c.put(f"{base}/serving", json=serving),
        c.delete(f"{base}/serving", params={"engine_id": engine_id}),
        c.delete(f"{base}/agents/1", params={"engine_id": engine_id}),
    ]


def test_a_scoped_token_runs_a_group_in_its_scope_from_open_to_deregistration(
    node7: httpx.Client,
) -> None:
    for group in (gid("p7"), gid("d7"), "exact-7"):
        engine = ok(node7.put(f"/tp-groups/{group}/engine", json=open_body(tp_size=2)))
        base = f"/tp-groups/{group}/engine"
        eid = engine["engine_id"]
        # Each record names the token that wrote it (never the token itself).
        assert ok(node7.put(f"{base}/agents/0", json=agent_body(eid, 0)))["registered_by"] == (
            "node-7"
        )
        batched = ok(node7.put(f"{base}/agents", json=batch(eid, 1)))
        assert [a["registered_by"] for a in batched["agents"]] == ["node-7"]
        ok(node7.post(f"{base}/agents/0/heartbeat", json={"engine_id": eid}))
        ok(node7.post(f"{base}/agents/heartbeat", json={"engine_id": eid, "ranks": [0, 1]}))
        serving = {"engine_id": eid, "url": "http://10.7.0.1:8000", "model": "m"}
        assert ok(node7.put(f"{base}/serving", json=serving))["serving"]["published_by"] == (
            "node-7"
        )
        ok(node7.delete(f"{base}/serving", params={"engine_id": eid}))
        ok(node7.delete(f"{base}/agents/1", params={"engine_id": eid}))
        relaunched = ok(node7.put(base, json=open_body(tp_size=2)))
        assert relaunched["generation"] == engine["generation"] + 1
        # The engine names the token that opened it, in every read.
        assert engine["opened_by"] == relaunched["opened_by"] == "node-7"
        assert ok(node7.get(base))["opened_by"] == "node-7"
        # Through FastAPI's stack too (a query string: never the fast path's).
        stacked = ok(node7.put(base, params={"via": "stack"}, json=open_body(tp_size=2)))
        assert stacked["opened_by"] == "node-7"
    # Reads are not scoped: a scoped worker token reads every group.
    assert node7.get("/tp-groups").status_code == 200


def test_a_scoped_token_is_refused_outside_its_scope_on_every_write_route(
    node7: httpx.Client, shared: httpx.Client
) -> None:
    # Neighbours of the scope: another prefix, the prefix without its dash, an exact id's
    # longer sibling.
    for group in (gid("p8"), gid("p70"), gid("d7x"), "exact-70"):
        engine = ok(shared.put(f"/tp-groups/{group}/engine", json=open_body(tp_size=2)))
        eid = engine["engine_id"]
        ok(shared.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0)))
        for resp in every_write(node7, group, eid):
            out_of_scope(resp, group)
        # Nothing changed: the same engine, its one rank, not serving.
        after = ok(shared.get(f"/tp-groups/{group}/engine"))
        assert (after["engine_id"], after["serving"]) == (eid, None)
        assert after["registered_ranks"] == [0]
        # The unscoped token (single-tenant set-ups) writes it as before.
        beat = shared.post(f"/tp-groups/{group}/engine/agents/0/heartbeat", json={"engine_id": eid})
        assert beat.status_code == 200, beat.text
        relaunched = ok(shared.put(f"/tp-groups/{group}/engine", json=open_body()))
        assert (relaunched["generation"], relaunched["opened_by"]) == (2, "worker#2")
    fresh = gid("x7")  # a group nobody opened: refused before it is looked up
    out_of_scope(node7.put(f"/tp-groups/{fresh}/engine", json=open_body()), fresh)


def handshake(c: httpx.Client, prefill_eid: str, decode: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"tp_size": 1, "rank": 0}
    if decode is not None:
        body["decode"] = decode
    return c.post(f"/engines/{prefill_eid}/handshake", json=body)


def test_a_decode_handshake_names_only_a_decode_group_in_the_tokens_scope(
    node7: httpx.Client, shared: httpx.Client, server: RegistryProcess
) -> None:
    prefill = gid("p8")  # another node's prefill: any worker may read its handshake
    engine = ok(shared.put(f"/tp-groups/{prefill}/engine", json=open_body()))
    ok(shared.put(f"/tp-groups/{prefill}/engine/agents/0", json=agent_body(engine["engine_id"], 0)))
    mine, theirs = gid("d7"), gid("d8")
    decode = ok(node7.put(f"/tp-groups/{mine}/engine", json=open_body(role="decode")))
    other = ok(shared.put(f"/tp-groups/{theirs}/engine", json=open_body(role="decode")))
    side = {"group_id": mine, "engine_id": decode["engine_id"]}
    assert handshake(node7, engine["engine_id"], side).status_code == 200
    assert handshake(node7, engine["engine_id"], None).status_code == 200
    forged = {"group_id": theirs, "engine_id": other["engine_id"]}
    out_of_scope(handshake(node7, engine["engine_id"], forged), theirs)
    stacked = node7.post(  # a query string: FastAPI's route, not the fast path
        f"/engines/{engine['engine_id']}/handshake",
        params={"via": "stack"},
        json={"tp_size": 1, "rank": 0, "decode": forged},
    )
    out_of_scope(stacked, theirs)
    # The unscoped token may name any decode group (single-tenant set-ups).
    assert handshake(shared, engine["engine_id"], forged).status_code == 200
    # The events name the token that caused them, by its name.
    with client(server, READER) as reader:
        deadline = time.monotonic() + 15
        found: dict[str, str] = {}
        while len(found) < 2 and time.monotonic() < deadline:
            for event in reader.get("/events", params={"limit": 1000}).json()["events"]:
                fields = event["fields"]
                if event["kind"] == "handshake" and fields.get("engine_id") == engine["engine_id"]:
                    found[fields.get("decode_group_id", "")] = fields.get("token", "")
            time.sleep(0.1)
    assert found.get(mine) == "node-7", found
    assert found.get(theirs) == "worker#2", found
