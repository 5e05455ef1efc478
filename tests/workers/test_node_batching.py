"""Per-node publication: a node's first rank registers the node's agents in one batch request
and renews them with one heartbeat. Real registry process, real torchrun (gloo), real NIXL.

The request counts come from the registry's /metrics (`registry_http_requests_total` by
route template), which counts every request, unlike the rate-limited access log.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from registry_client.client import RegistryClient
from registry_client.models import AgentItem, KvSpec
from tests.workers.torchrun_support import Launch, launched, logs, reports, start_group, wait_all
from workers.identity import EngineIdentity
from workers.publication import BatchPublication

pytestmark = [pytest.mark.workers, pytest.mark.timeout(240)]

BATCH_PUT = ("PUT", "/tp-groups/{group_id}/engine/agents")
BATCH_HEARTBEAT = ("POST", "/tp-groups/{group_id}/engine/agents/heartbeat")
RANK_PUT = ("PUT", "/tp-groups/{group_id}/engine/agents/{rank}")
RANK_HEARTBEAT = ("POST", "/tp-groups/{group_id}/engine/agents/{rank}/heartbeat")
ROUTES = {
    BATCH_PUT: "batch PUT",
    BATCH_HEARTBEAT: "batch heartbeat",
    RANK_PUT: "per-rank PUT",
    RANK_HEARTBEAT: "per-rank heartbeat",
}
KV = KvSpec("DRAM", 0, [1 << 20], 4, 512, 4)


def requests_by_route(url: str) -> Counter[str]:
    """Successful requests so far, by what they were (ROUTES), and the renewals answered over
    keep-alive streams (``keep-alive renewal``: the lease keepers renew there by default)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "registry_keepalive_renewals_total":
                if sample.labels["outcome"] == "renewed":
                    counts["keep-alive renewal"] += int(sample.value)
                continue
            if sample.name != "registry_http_requests_total":
                continue
            key = (sample.labels["method"], sample.labels["route"])
            if key in ROUTES and sample.labels["status"].startswith("2"):
                counts[ROUTES[key]] += int(sample.value)
    return counts


def wait_ready(url: str, group_id: str, launches: list[Launch], ranks: list[int]) -> None:
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=url, timeout=20) as http:
        while time.monotonic() < deadline:
            answer = http.get(f"/tp-groups/{group_id}/engine", params={"wait_ready": 5})
            if answer.is_success and answer.json()["registered_ranks"] == ranks:
                return
            time.sleep(0.2)
    raise AssertionError(f"{group_id} never had ranks {ranks}:\n{logs(launches)}")


def serve_and_count(
    tmp_path: Path, url: str, group_id: str, mode: str, window_s: float
) -> tuple[Counter[str], Counter[str]]:
    """A prefill group of 4 ranks on 2 nodes: requests to get registered, then in a window."""
    before = requests_by_route(url)
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id=group_id,
        registry=url,
        tp=4,
        nodes=2,
        args=["--publish", mode, "--ttl-s", "5", "--serve-s", "90"],
    )
    with launched(prefill):
        wait_ready(url, group_id, prefill, [0, 1, 2, 3])
        registered = requests_by_route(url)
        time.sleep(window_s)
        serving = requests_by_route(url)
        for launch in prefill:
            launch.stop()
    found = reports(tmp_path, "prefill", group_id)
    assert [r["status"] for r in found] == ["done"] * 4, logs(prefill)
    return registered - before, serving - registered


def test_per_node_publication_makes_one_batch_put_per_node_instead_of_one_put_per_rank(
    tmp_path: Path, registry_url: str
) -> None:
    window_s = 5.0  # three heartbeat intervals (ttl 5 s / 3)
    node_reg, node_hb = serve_and_count(tmp_path, registry_url, "pn", "per-node", window_s)
    rank_reg, rank_hb = serve_and_count(tmp_path, registry_url, "pr", "per-rank", window_s)
    print(f"\nper-node: to register {dict(node_reg)}, serving {window_s}s {dict(node_hb)}")
    print(f"per-rank: to register {dict(rank_reg)}, serving {window_s}s {dict(rank_hb)}")

    assert node_reg["batch PUT"] == 2, "one batch registration per node"
    assert node_reg["per-rank PUT"] == 0
    assert rank_reg["per-rank PUT"] == 4
    assert rank_reg["batch PUT"] == 0
    assert node_hb["per-rank heartbeat"] == rank_hb["batch heartbeat"] == 0
    # A renewal is one request or one keep-alive message: a node's covers its ranks.
    node_renewals = node_hb["batch heartbeat"] + node_hb["keep-alive renewal"]
    rank_renewals = rank_hb["per-rank heartbeat"] + rank_hb["keep-alive renewal"]
    assert node_renewals > 0
    assert node_renewals < rank_renewals
    with httpx.Client(base_url=registry_url, timeout=10) as http:
        for group_id in ("pn", "pr"):
            engine = http.get(f"/tp-groups/{group_id}/engine").json()
            assert engine["registered_ranks"] == [], f"{group_id}: the leaders deregistered"


def test_a_superseded_node_leader_stops_its_followers_too(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=2,
        args=["--ttl-s", "5", "--serve-s", "60"],
    )
    with launched(prefill), httpx.Client(base_url=registry_url, timeout=20) as http:
        wait_ready(registry_url, "pf", prefill, [0, 1])
        newer = http.put(
            "/tp-groups/pf/engine",
            json={"launch_id": "someone-else", "tp_size": 2, "role": "prefill"},
        )
        assert newer.status_code == 201
        assert wait_all(prefill, 60) != [0]
    found = reports(tmp_path, "prefill", "pf")
    assert [r["status"] for r in found] == ["superseded", "superseded"], logs(prefill)
    log = prefill[0].log()
    assert "NODE 0 RANKS [0, 1] OF ENGINE" in log
    assert "RANK 1 OF ENGINE" in log
    assert "its node's leader, rank 0, was told so" in log


def test_a_node_whose_ranks_cannot_publish_fails_the_whole_group_and_nothing_stays_registered(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=4,
        nodes=2,
        args=["--serve-s", "30"],
        env=[{}, {"WORKERS_ADVERTISE_HOST": "0.0.0.0"}],
    )
    with launched(prefill):
        codes = wait_all(prefill, 120)
    assert all(code != 0 for code in codes), logs(prefill)
    found = reports(tmp_path, "prefill", "pf")
    assert [r["status"] for r in found] == ["refused"] * 4, logs(prefill)
    for r in found:
        assert r["causes"] == {"2": "publish_failed", "3": "publish_failed"}
        assert "unspecified address 0.0.0.0" in r["error"]
    with httpx.Client(base_url=registry_url, timeout=10) as http:
        engine = http.get("/tp-groups/pf/engine").json()
    assert requests_by_route(registry_url)["batch PUT"] == 1, "node 0 registered its ranks"
    assert engine["registered_ranks"] == [], "... and deregistered them when the group failed"


def test_a_batch_publication_renews_registers_again_after_404_and_stops_on_409(
    registry_url: str,
) -> None:
    with RegistryClient(registry_url, timeout_s=10) as client:
        engine, _ = client.open_engine("g", launch_id="l1", tp_size=3, role="prefill")
        identity = EngineIdentity("g", engine.engine_id, 1, registry_url, "l1")
        items = [AgentItem(r, engine.engine_id, f"a{r}", b"md", "127.0.0.1", KV) for r in (2, 0)]
        superseded: list[str] = []
        publication = BatchPublication(
            lambda: RegistryClient(registry_url, timeout_s=5),
            identity,
            items,
            ttl_s=5,
            fraction=0.05,
            on_superseded=lambda exc: superseded.append(exc.cause),
        )
        try:
            assert publication.publish()
            assert publication.ranks == [0, 2]
            publication.start()
            deadline = time.monotonic() + 10
            while publication.heartbeats < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert publication.heartbeats >= 2
            client.deregister_agent("g", 2, engine_id=engine.engine_id)
            while publication.reregistrations < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert publication.reregistrations == 1
            assert client.get_engine("g").registered_ranks == [0, 2]
            client.open_engine("g", launch_id="l2", tp_size=3, role="prefill")
            assert publication.superseded.wait(10)
            assert superseded == ["superseded"]
        finally:
            publication.close()
