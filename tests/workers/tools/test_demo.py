"""`engine-registry demo`, run as a user runs it: one command, real processes throughout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.server import ROOT

pytestmark = [pytest.mark.workers, pytest.mark.timeout(150)]

SMALL = [
    "--blocks",
    "4",
    "--block-size",
    "4",
    "--num-heads",
    "2",
    "--head-size",
    "16",
    "--num-layers",
    "1",
    "--timeout-s",
    "100",
    "--quiet",
]


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", "demo", *args, *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=130,
        check=False,
    )


def test_demo_moves_blocks_from_a_two_node_prefill_to_a_decode_and_verifies_every_byte() -> None:
    run = demo("--prefill-tp", "2", "--prefill-nodes", "2", "--decode-tp", "1", "--rounds", "2")

    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "RESULT: every byte verified" in run.stdout
    assert "handshake" in run.stdout
    assert "throughput" in run.stdout


def test_demo_with_local_engine_ids_reproduces_the_bug_and_shows_the_refusal() -> None:
    run = demo("--engine-id-source", "local", "--decode-tp", "1")

    assert run.returncode != 0
    assert "different engine_ids: the bug" in run.stdout
    assert "never issued" in run.stdout
    assert "RESULT: FAILED" in run.stdout
