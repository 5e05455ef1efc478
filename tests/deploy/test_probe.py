"""`engine-registry probe`: the readiness gate of an engine's leader pod (deploy/k8s).

Against a real registry process with tokens: exit 1 naming the missing ranks until every rank
registered, 0 then; 1 when the current engine is another launch's (a recreated group whose new
rank 0 has not opened yet, while the old agents' leases still run); 2 for usage errors; 3 when
no registry answers within --timeout, and that deadline holds against a registry that never
answers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import RegistryProcess, free_port

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(60)]

WORKER = "worker-token-for-probe-tests-0123"
READER = "reader-token-for-probe-tests-0123"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"worker:{WORKER}\nreader:{READER}\n")
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        log_path=tmp_path / "registry.log",
    ) as server:
        yield server


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if "REGISTRY" not in k}
    return subprocess.run(
        [sys.executable, "-m", "app", "probe", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def open_engine(url: str, group: str, launch_id: str, tp_size: int) -> str:
    answer = httpx.put(
        f"{url}/tp-groups/{group}/engine",
        json={"launch_id": launch_id, "tp_size": tp_size, "role": "prefill"},
        headers={"Authorization": f"Bearer {WORKER}"},
        timeout=10,
    )
    assert answer.status_code in (200, 201), answer.text
    return str(answer.json()["engine_id"])


def register(url: str, group: str, engine_id: str, rank: int) -> None:
    answer = httpx.put(
        f"{url}/tp-groups/{group}/engine/agents/{rank}",
        json={
            "engine_id": engine_id,
            "agent_name": f"a{rank}",
            "agent_metadata": "aGVsbG8=",
            "host": "127.0.0.1",
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [4096],
                "num_blocks": 1,
                "block_len": 64,
            },
        },
        headers={"Authorization": f"Bearer {WORKER}"},
        timeout=10,
    )
    assert answer.status_code in (200, 201), answer.text


def test_probe_turns_ready_only_when_every_rank_of_this_launch_registered(
    registry: RegistryProcess, tmp_path: Path
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text(WORKER + "\n")
    common = ["--url", registry.url, "--group", "prefill-0", "--token-file", str(token_file)]

    missing = probe(*common)
    assert missing.returncode == 1, missing
    assert "no engine" in missing.stdout

    engine_id = open_engine(registry.url, "prefill-0", "launch-a", 2)
    register(registry.url, "prefill-0", engine_id, 0)
    partial = probe(*common, "--launch-id", "launch-a")
    assert partial.returncode == 1, partial
    assert "1/2 ranks registered, missing ranks 1" in partial.stdout

    register(registry.url, "prefill-0", engine_id, 1)
    ready = probe(*common, "--launch-id", "launch-a")
    assert ready.returncode == 0, ready
    assert f"engine {engine_id}" in ready.stdout

    # The token from the environment, the group and launch from the plugin's own variables
    # (what the pod's probe uses): a recreated group's leader is not ready on the old agents.
    env = {
        "REGISTRY_TOKEN": READER,
        "ENGINE_REGISTRY_URL": registry.url,
        "ENGINE_REGISTRY_GROUP": "prefill-0",
        "ENGINE_REGISTRY_LAUNCH_ID": "launch-b",
    }
    other = probe(env=env)
    assert other.returncode == 1, other
    assert "belongs to launch launch-a, not this one (launch-b)" in other.stdout
    open_engine(registry.url, "prefill-0", "launch-b", 2)
    reopened = probe(env=env)
    assert reopened.returncode == 1, reopened
    assert "generation 2" in reopened.stdout
    assert "missing ranks 0,1" in reopened.stdout


def test_probe_usage_errors_exit_2(registry: RegistryProcess, tmp_path: Path) -> None:
    no_group = probe("--url", registry.url)
    assert no_group.returncode == 2
    assert "--group" in no_group.stderr
    no_file = probe("--url", registry.url, "--group", "g", "--token-file", str(tmp_path / "nope"))
    assert no_file.returncode == 2
    assert "cannot read --token-file" in no_file.stderr


def test_probe_exit_3_names_each_registry_and_the_cause(registry: RegistryProcess) -> None:
    wrong_token = probe("--url", registry.url, "--group", "g", env={"REGISTRY_TOKEN": "x" * 20})
    assert wrong_token.returncode == 3, wrong_token
    assert "answered 401" in wrong_token.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    # A dead replica first: the probe moves on to the live one within its deadline.
    failover = probe(
        "--url", f"{dead},{registry.url}", "--group", "g", env={"REGISTRY_TOKEN": READER}
    )
    assert failover.returncode == 1, failover
    assert "no engine" in failover.stdout


def test_probe_deadline_holds_against_a_registry_that_never_answers() -> None:
    # What the interpreter and the probe's imports take on this machine right now (a loaded
    # 2-core machine takes seconds), so that only the probe's own wait is bounded.
    started = time.monotonic()
    probe("--help")
    startup = time.monotonic() - started
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        run = probe("--url", url, "--group", "g", "--timeout", "1.5")
        took = time.monotonic() - started
    assert run.returncode == 3, run
    assert "ReadTimeout" in run.stderr
    assert took < 1.5 + startup * 1.5 + 1.0, (took, startup)  # the deadline plus start-up
