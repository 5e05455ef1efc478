"""Prefill and decode TP groups under real torchrun, real NIXL (UCX, DRAM), a real registry.

Every decode rank verifies byte for byte that it read its own heads of the chosen blocks,
written by the engine it handshook with; the tests check who read what from whom.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.torchrun_support import launched, logs, start_group, wait_all, wait_for_report
from tests.workers.torchrun_support import reports as read_reports

pytestmark = [pytest.mark.workers, pytest.mark.timeout(150)]


def run_pd(
    tmp_path: Path,
    url: str,
    *,
    prefill_tp: int,
    prefill_nodes: int,
    decode_tp: int,
    rounds: int = 1,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    readers = max(1, decode_tp // prefill_tp) * rounds
    prefill = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=url,
        tp=prefill_tp,
        nodes=prefill_nodes,
        args=["--exit-after-notifs", str(readers), "--serve-s", "90"],
    )
    decode = start_group(
        "decode",
        tmp_path,
        group_id="dc",
        registry=url,
        tp=decode_tp,
        args=["--prefill-group", "pf", "--rounds", str(rounds), "--deadline-s", "90"],
    )
    with launched(prefill, decode) as everything:
        codes = wait_all(everything, 120)
        assert codes == [0] * len(everything), logs(everything)
    return read_reports(tmp_path, "prefill", "pf"), read_reports(tmp_path, "decode", "dc")


def assert_every_byte_verified(decode: list[dict[str, Any]], engine_id: object) -> None:
    for report in decode:
        rounds = report["rounds"]
        assert isinstance(rounds, list)
        assert rounds
        for figures in rounds:
            assert figures["engine_id"] == engine_id
            assert figures["bytes"] == figures["verified_bytes"] > 0
        assert report["status"] == "done"


def test_decode_with_same_tp_reads_verified_blocks_from_a_prefill_split_over_two_nodes(
    tmp_path: Path, registry_url: str
) -> None:
    prefill, decode = run_pd(tmp_path, registry_url, prefill_tp=2, prefill_nodes=2, decode_tp=2)

    assert [r["node"] for r in prefill] == [0, 1]
    engine_ids = {r["engine_id"] for r in prefill}
    assert len(engine_ids) == 1, "both nodes must hold the registry-issued engine_id"
    (engine_id,) = engine_ids
    assert_every_byte_verified(decode, engine_id)
    assert [r["rounds"][0]["targets"] for r in decode] == [[0], [1]]
    assert all(r["verified_notifs"] == 1 for r in prefill)


def test_decode_with_larger_tp_reads_its_head_slice_of_the_one_prefill_rank(
    tmp_path: Path, registry_url: str
) -> None:
    prefill, decode = run_pd(tmp_path, registry_url, prefill_tp=1, prefill_nodes=1, decode_tp=2)

    assert_every_byte_verified(decode, prefill[0]["engine_id"])
    assert [r["rounds"][0]["targets"] for r in decode] == [[0], [0]]
    # Each decode rank moved half of the prefill rank's bytes: two heads of four.
    half = prefill[0]["kv_bytes"] // 2
    assert [r["rounds"][0]["bytes"] for r in decode] == [half, half]
    assert prefill[0]["verified_notifs"] == 2


def test_decode_with_smaller_tp_gathers_whole_blocks_from_several_prefill_ranks(
    tmp_path: Path, registry_url: str
) -> None:
    prefill, decode = run_pd(tmp_path, registry_url, prefill_tp=2, prefill_nodes=1, decode_tp=1)

    assert_every_byte_verified(decode, prefill[0]["engine_id"])
    assert decode[0]["rounds"][0]["targets"] == [0, 1]
    total = sum(r["kv_bytes"] for r in prefill)
    assert decode[0]["rounds"][0]["bytes"] == total


def test_a_running_decode_follows_a_prefill_relaunch_through_410_and_verifies_the_new_engine(
    tmp_path: Path, registry_url: str
) -> None:
    first = start_group(
        "prefill",
        tmp_path,
        group_id="pf",
        registry=registry_url,
        tp=1,
        args=["--serve-s", "90"],
    )
    decode = start_group(
        "decode",
        tmp_path,
        group_id="dc",
        registry=registry_url,
        tp=1,
        args=[
            "--prefill-group",
            "pf",
            "--rounds",
            "2",
            "--until-engines",
            "2",
            "--round-interval-s",
            "0.3",
            "--deadline-s",
            "90",
            "--handshake-timeout-s",
            "30",
        ],
    )
    with launched(first, decode):
        wait_for_report(tmp_path, "decode", "dc", lambda r: r[0].get("rounds"), timeout_s=60)
        old_engine = read_reports(tmp_path, "prefill", "pf")[0]["engine_id"]
        first[0].signal(signal.SIGTERM)  # a clean stop: the agent deregisters
        wait_all(first, 30)  # torchrun itself exits non-zero on SIGTERM; the rank reports
        stopped = read_reports(tmp_path, "prefill", "pf")[0]
        assert stopped["status"] == "done", logs(first)
        with httpx.Client(base_url=registry_url, timeout=10) as http:
            engine = http.get("/tp-groups/pf/engine").json()
        assert engine["engine_id"] == old_engine
        assert engine["registered_ranks"] == [], "a clean SIGTERM shutdown deregisters"

        second = start_group(
            "prefill",
            tmp_path,
            group_id="pf",
            registry=registry_url,
            tp=1,
            args=["--serve-s", "90"],
        )
        with launched(second):
            assert wait_all(decode, 90) == [0], logs(decode + second)
            new = read_reports(tmp_path, "prefill", "pf")[0]
            assert new["engine_id"] != old_engine
            assert new["generation"] == 2

    (report,) = read_reports(tmp_path, "decode", "dc")
    assert report["engines_seen"] == [old_engine, new["engine_id"]]
    last = report["rounds"][-1]
    assert last["engine_id"] == new["engine_id"]
    assert last["generation"] == 2
    assert last["bytes"] == last["verified_bytes"] > 0
    assert "answered 410" in decode[0].log()
    with httpx.Client(base_url=registry_url, timeout=10) as http:
        gone = http.get(f"/engines/{old_engine}")
    assert gone.status_code == 410
    assert gone.json()["current_engine_id"] == new["engine_id"]


def test_a_decode_whose_kv_layout_differs_is_refused_at_the_handshake_and_reads_nothing(
    tmp_path: Path, registry_url: str
) -> None:
    prefill = start_group(
        "prefill", tmp_path, group_id="pf", registry=registry_url, tp=1, args=["--serve-s", "60"]
    )
    decode = start_group(
        "decode",
        tmp_path,
        group_id="dc",
        registry=registry_url,
        tp=1,
        args=["--prefill-group", "pf", "--block-size", "8", "--deadline-s", "60"],
    )
    with launched(prefill, decode):
        assert wait_all(decode, 90) != [0]
    (report,) = read_reports(tmp_path, "decode", "dc")
    assert report["status"] == "refused"
    assert "incompatible" in report["error"]
    assert report["rounds"] == []
    assert "CANNOT READ FROM ENGINE" in decode[0].log()
