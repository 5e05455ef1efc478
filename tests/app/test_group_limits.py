"""What one group may hold (issue #39, item 3), against a real registry process: a TP size, an
agent name or a host past its limit is refused (422), and one group at every limit at once
(the largest TP, names and hosts at their lengths) makes a watch line of at most 512 KiB. At
the former limits (TP 65,536, names of 256) that line was 39,037,550 bytes."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.core.schemas import MAX_AGENT_NAME, MAX_BATCH, MAX_HOST, MAX_TP_SIZE
from harness.server import RegistryProcess
from tests.support.hostile import assert_problem, serve

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

WORST_LINE_BYTES = 512 * 1024
KV = {"mem_type": "DRAM", "device_id": 0, "base_addrs": [4096], "num_blocks": 8, "block_len": 4096}


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    where = tmp_path_factory.mktemp("group-limits")
    proc: RegistryProcess = serve(where, where / "registry.db")
    try:
        with httpx.Client(base_url=proc.url, timeout=60.0) as client:
            yield client
    finally:
        proc.kill()


def host_of(length: int) -> str:
    """A DNS name of exactly ``length`` characters (labels of at most 63)."""
    labels: list[str] = []
    while sum(len(x) + 1 for x in labels) + 63 < length:
        labels.append("h" * 63)
    labels.append("t" * (length - sum(len(x) + 1 for x in labels)))
    name = ".".join(labels)
    assert len(name) == length
    return name


def open_group(http: httpx.Client, tp: int) -> httpx.Response:
    body = {"launch_id": uuid.uuid4().hex, "tp_size": tp, "role": "prefill"}
    return http.put(f"/tp-groups/g-{uuid.uuid4().hex[:8]}/engine", json=body)


def agent(eid: str, rank: int, name_len: int, host: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "engine_id": eid,
        "agent_name": f"{rank:05d}".ljust(name_len, "n"),
        "agent_metadata": base64.b64encode(b"nixl").decode(),
        "host": host,
        "kv": KV,
        "ttl_s": 3600,
    }


def test_past_a_group_limit_is_422(http: httpx.Client) -> None:
    assert_problem(open_group(http, MAX_TP_SIZE + 1), 422, "invalid_request")
    assert_problem(open_group(http, 65536), 422, "invalid_request")
    engine = open_group(http, 1).json()
    url = f"/tp-groups/{engine['group_id']}/engine/agents"
    too_long = [agent(engine["engine_id"], 0, MAX_AGENT_NAME + 1, "10.0.0.1")]
    assert_problem(http.put(url, json={"agents": too_long}), 422, "invalid_request")
    control = [agent(engine["engine_id"], 0, 8, "10.0.0.1") | {"agent_name": "a\nb"}]
    assert_problem(http.put(url, json={"agents": control}), 422, "invalid_request")
    host = [agent(engine["engine_id"], 0, 8, host_of(MAX_HOST + 1))]
    assert_problem(http.put(url, json={"agents": host}), 422, "invalid_request")


def test_one_group_at_every_limit_makes_a_small_watch_line(http: httpx.Client) -> None:
    opened = open_group(http, MAX_TP_SIZE)
    assert opened.status_code == 201, opened.text
    engine = opened.json()
    gid, eid = engine["group_id"], engine["engine_id"]
    host = host_of(MAX_HOST)
    revision = 0
    for start in range(0, MAX_TP_SIZE, MAX_BATCH):
        revision = http.get("/tp-groups", params={"limit": 1}).json()["revision"]
        ranks = range(start, min(MAX_TP_SIZE, start + MAX_BATCH))
        batch = [agent(eid, r, MAX_AGENT_NAME, host) for r in ranks]
        resp = http.put(f"/tp-groups/{gid}/engine/agents", json={"agents": batch})
        assert resp.status_code in (200, 201), resp.text[:300]
    params: dict[str, str | int] = {"watch": "true", "revision": revision}
    with http.stream("GET", "/tp-groups", params=params, timeout=30.0) as stream:
        line = next(stream.iter_lines())
    change = httpx.Response(200, content=line).json()
    assert change["object"]["group_id"] == gid, line[:200]
    assert len(change["object"]["registered_ranks"]) == MAX_TP_SIZE
    size = len(line.encode())
    print(f"the worst group's watch line: {size} bytes")
    assert size <= WORST_LINE_BYTES, size
