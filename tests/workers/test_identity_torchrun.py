"""The engine_id a TP group spanning two torchrun "nodes" agrees on, and how it fails.

Every failure is group-wide: each rank ends with the same verdict naming the failing rank
and the cause, and no rank is left waiting in a collective (every launch exits in time).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.torchrun_support import (
    Launch,
    free_port,
    launched,
    logs,
    reports,
    start_group,
    wait_all,
)

pytestmark = [pytest.mark.workers, pytest.mark.timeout(120)]

PREFILL_ARGS = ["--serve-s", "30", "--exit-after-notifs", "1"]


def run_failing_prefill(
    tmp_path: Path,
    *,
    group_id: str | list[str],
    registry: str | list[str],
    args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """A prefill group of two ranks on two nodes that must fail; every rank's report."""
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id=group_id,
        registry=registry,
        tp=2,
        nodes=2,
        args=[*PREFILL_ARGS, *args],
    )
    with launched(prefill):
        codes = wait_all(prefill, 90)
    assert all(code != 0 for code in codes), logs(prefill)
    found = reports(tmp_path, "prefill", "*")
    assert [r["rank"] for r in found] == [0, 1], logs(prefill)
    return found


def agent_ranks(url: str, group_id: str) -> list[int]:
    with httpx.Client(base_url=url, timeout=10) as http:
        engine = http.get(f"/tp-groups/{group_id}/engine").json()
    return list(engine["registered_ranks"])


def test_bug_reproduced_each_node_makes_up_its_own_engine_id_and_the_registry_refuses_them(
    tmp_path: Path, registry_url: str
) -> None:
    found = run_failing_prefill(
        tmp_path, group_id="pf", registry=registry_url, args=("--engine-id-source", "local")
    )

    node_ids = [r["engine_id"] for r in found]
    assert node_ids[0] != node_ids[1], "each node made up its own id: the original bug"
    for r in found:
        assert r["status"] == "refused"
        assert r["causes"] == {"0": "registry_refused:unknown", "1": "registry_refused:unknown"}
        assert "never issued" in r["error"]
    assert agent_ranks(registry_url, "pf") == []


def test_nodes_pointed_at_different_registries_fail_the_cross_verify_on_every_rank(
    tmp_path: Path, registry_url: str, other_registry_url: str
) -> None:
    found = run_failing_prefill(
        tmp_path, group_id="pf", registry=[registry_url, other_registry_url]
    )

    for r in found:
        assert r["status"] == "identity_failed"
        assert r["causes"] == {"1": "different_registry"}
        assert other_registry_url in r["error"]
        assert "never issued" in r["error"]
    assert agent_ranks(registry_url, "pf") == []


def test_a_group_id_differing_on_one_node_fails_the_cross_verify_on_every_rank(
    tmp_path: Path, registry_url: str
) -> None:
    found = run_failing_prefill(tmp_path, group_id=["pf", "pf-typo"], registry=registry_url)

    for r in found:
        assert r["status"] == "identity_failed"
        assert r["causes"] == {"1": "different_group"}
        assert "'pf-typo'" in r["error"]
    assert agent_ranks(registry_url, "pf") == []


def wait_until_ready(http: httpx.Client, group_id: str, launches: list[Launch]) -> Any:
    """The group's engine once every rank registered (the group may not exist yet)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = http.get(f"/tp-groups/{group_id}/engine", params={"wait_ready": 5})
        if answer.is_success and answer.json()["ready"]:
            return answer.json()
        time.sleep(0.2)
    raise AssertionError(f"{group_id} never ready:\n{logs(launches)}")


def test_a_group_on_two_nodes_agrees_on_the_registry_issued_engine_id(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=2,
        nodes=2,
        args=["--serve-s", "60"],
    )
    with launched(prefill), httpx.Client(base_url=registry_url, timeout=70) as http:
        engine = wait_until_ready(http, "pf", prefill)
        assert engine["registered_ranks"] == [0, 1]
        found = reports(tmp_path, "prefill", "pf")
    assert {r["engine_id"] for r in found} == {engine["engine_id"]}
    assert [r["node"] for r in found] == [0, 1]


def test_a_serving_prefill_superseded_by_a_newer_launch_stops_loudly_on_its_next_heartbeat(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=1,
        args=["--serve-s", "60", "--ttl-s", "5"],
    )
    with launched(prefill), httpx.Client(base_url=registry_url, timeout=70) as http:
        old = wait_until_ready(http, "pf", prefill)["engine_id"]
        newer = http.put(
            "/tp-groups/pf/engine",
            json={"launch_id": "someone-else", "tp_size": 1, "role": "prefill"},
        )
        assert newer.status_code == 201
        assert wait_all(prefill, 30) != [0]

    (report,) = reports(tmp_path, "prefill", "pf")
    assert report["engine_id"] == old
    assert report["status"] == "superseded"
    assert "IS SUPERSEDED" in prefill[0].log()


def test_with_fallback_allowed_an_unreachable_registry_leaves_every_node_on_rank_zeros_id(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=dead,
        tp=2,
        nodes=2,
        args=["--allow-fallback", "--timeout-s", "1", "--serve-s", "1"],
    )
    with launched(prefill):
        assert wait_all(prefill, 90) == [0, 0], logs(prefill)

    found = reports(tmp_path, "prefill", "pf")
    assert [r["engine_id_source"] for r in found] == ["fallback", "fallback"]
    assert found[0]["engine_id"] == found[1]["engine_id"]
    assert "REGISTRY UNREACHABLE" in prefill[0].log()
    assert all("NOT PUBLISHED" in launch.log() for launch in prefill)


def test_a_serving_rank_whose_agent_vanished_registers_again_on_its_next_heartbeat(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=1,
        args=["--serve-s", "60", "--ttl-s", "5"],
    )
    with launched(prefill), httpx.Client(base_url=registry_url, timeout=70) as http:
        engine_id = wait_until_ready(http, "pf", prefill)["engine_id"]
        gone = http.delete("/tp-groups/pf/engine/agents/0", params={"engine_id": engine_id})
        assert gone.status_code == 204
        assert http.get("/tp-groups/pf/engine").json()["registered_ranks"] == []
        again = wait_until_ready(http, "pf", prefill)
        assert again["engine_id"] == engine_id
    assert "registering again" in prefill[0].log()
