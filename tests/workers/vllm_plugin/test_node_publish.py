"""The plugin's one publication per node (`workers.vllm_plugin.node_publish`) over a real gloo
group spanning two torchrun "nodes" of two ranks each, against a real registry process. The
agents are stand-ins (named so in `node_publish_main.py`): vLLM's connector describes the real
ones, which the real-vLLM tier publishes the same way. Request counts come from the registry's
`/metrics` by route (`test_node_batching.requests_by_route`)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.test_node_batching import requests_by_route
from tests.workers.torchrun_support import Launch, free_port, launched, logs, wait_all

pytestmark = [pytest.mark.workers, pytest.mark.serial, pytest.mark.timeout(180)]

SERVE_S = 5.0  # three heartbeat intervals of the 5 s lease


def run_group(
    tmp_path: Path, url: str, group_id: str, *, fail_rank: int = -1
) -> tuple[list[int], list[dict[str, Any]], list[Launch]]:
    """Two nodes of two ranks; each rank's exit code and report."""
    port = free_port()
    out = tmp_path / f"reports-{group_id}"
    out.mkdir()
    launches = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--nproc-per-node",
            "2",
            "-m",
            "tests.workers.vllm_plugin.node_publish_main",
            url,
            group_id,
            str(out),
            str(SERVE_S),
            str(fail_rank),
        ]
        launches.append(Launch(f"{group_id}-node{node}", cmd, tmp_path / f"{group_id}{node}.log"))
    with launched(launches):
        codes = wait_all(launches, 120)
    found = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return codes, sorted(found, key=lambda r: int(r["rank"])), launches


def test_each_node_registers_and_renews_its_ranks_in_one_request(
    tmp_path: Path, registry_url: str
) -> None:
    before = requests_by_route(registry_url)
    codes, found, launches = run_group(tmp_path, registry_url, "pn")
    counts = requests_by_route(registry_url) - before
    print(f"\nper node, 2 nodes x 2 ranks, {SERVE_S:.0f} s served: {dict(counts)}")
    assert codes == [0, 0], logs(launches)
    assert [r["status"] for r in found] == ["ok"] * 4, logs(launches)
    assert [(r["rank"], r["leader"], r["ranks"]) for r in found] == [
        (0, 0, [0, 1]),
        (1, 0, [0, 1]),
        (2, 2, [2, 3]),
        (3, 2, [2, 3]),
    ]
    assert counts["batch PUT"] == 2, "one registration a node"
    assert counts["per-rank PUT"] == 0
    assert counts["per-rank heartbeat"] == 0
    beats = [r["heartbeats"] for r in found if "heartbeats" in r]
    assert len(beats) == 2, "only the leaders keep a lease"
    # a leader renews its node's ranks in one request or one keep-alive message
    renewals = counts["batch heartbeat"] + counts["keep-alive renewal"]
    assert renewals == sum(beats) >= 2, (counts, beats)
    with httpx.Client(base_url=registry_url, timeout=10) as http:
        engine = http.get("/tp-groups/pn/engine").json()
    assert engine["registered_ranks"] == [], "the leaders deregistered their nodes"


def test_a_rank_that_cannot_describe_its_agent_fails_every_rank_and_leaves_nothing(
    tmp_path: Path, registry_url: str
) -> None:
    before = requests_by_route(registry_url)
    codes, found, launches = run_group(tmp_path, registry_url, "pf", fail_rank=3)
    counts = requests_by_route(registry_url) - before
    assert all(code != 0 for code in codes), logs(launches)
    assert [r["status"] for r in found] == ["refused"] * 4, logs(launches)
    for r in found:
        assert r["causes"] == {"3": "publish_failed"}, r
        assert "rank 3 has no KV caches" in r["error"]
    assert counts["batch PUT"] == 1, "node 0 registered; node 1 (rank 3's) did not"
    with httpx.Client(base_url=registry_url, timeout=10) as http:
        engine = http.get("/tp-groups/pf/engine").json()
    assert engine["registered_ranks"] == [], "... and node 0 deregistered when the group failed"


def test_the_plugins_requests_name_group_node_and_pid_in_the_registrys_access_log(
    tmp_path: Path, registry_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How the real-vLLM tier counts a node's requests (`registry_requests.py`)."""
    from workers.vllm_plugin import common
    from workers.vllm_plugin.settings import PluginSettings

    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--headless", "--node-rank", "3"])
    monkeypatch.setattr(common, "_node", None)
    settings = PluginSettings(url=registry_url, group="ua-group")
    with common.client(settings) as client:
        client.request("GET", "/tp-groups")
    common.set_node("elsewhere/1")
    with common.client(settings) as client:
        client.request("GET", "/tp-groups")
    agents: list[str] = []
    deadline = time.monotonic() + 10
    while len(agents) < 2 and time.monotonic() < deadline:
        lines = (tmp_path / "registry.log").read_text().splitlines()
        agents = [
            json.loads(line).get("user_agent") or "" for line in lines if '"/tp-groups"' in line
        ]
        time.sleep(0.05)
    host, pid = socket.gethostname(), os.getpid()
    assert agents == [
        f"engine-registry-workers vllm-plugin (group ua-group; node {host}/3; pid {pid})",
        f"engine-registry-workers vllm-plugin (group ua-group; node elsewhere/1; pid {pid})",
    ]
