"""A real smg (SGLang's model gateway, PD mode, no worker on its command line) fed only by
`engine-registry router-sync`, in front of a real prefill and a real decode served by vLLM's
gRPC entrypoint (``vllm serve --grpc``, NixlConnector on CPU, the plugin on: the registry
gives each launch its engine id and the decode's handshake goes through it).

A completion through smg is PD (NIXL reads counted on decode's ``/metrics``) and its text is
the prefill's own greedy text (a plain smg in front of the prefill alone); the prefill
relaunched on another port leaves smg's own worker list within 1 s of the registry's new
generation, the new one is listed with its new engine id, and the next requests succeed
without restarting smg; a prefill of another dtype is never registered.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.vllm_plugin.conftest import FIGURES
from tests.workers.vllm_plugin.grpc_instance import GrpcInstance
from tests.workers.vllm_plugin.pd_shared import PROMPT
from workers.tools.routers import RouterSyncProcess, SmgProcess
from workers.tools.vllm_launch import Registry
from workers.tools.vllm_pd import nixl_transfers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
START_S = 600.0


class Parts:
    """What the test starts, stopped together whatever happens."""

    def __init__(self) -> None:
        self.instances: list[GrpcInstance] = []
        self.others: list[Any] = []

    def stop(self) -> None:
        for thing in self.others:
            thing.stop()
        for instance in self.instances:
            instance.stop()


@pytest.fixture
def parts() -> Iterator[Parts]:
    made = Parts()
    try:
        yield made
    finally:
        made.stop()


def launch(parts: Parts, name: str, group: str, role: str, **kw: Any) -> GrpcInstance:
    model, workdir, registry = kw.pop("model"), kw.pop("workdir"), kw.pop("registry")
    instance = GrpcInstance(
        name,
        model,
        workdir,
        registry_url=registry.url,
        registry_token=registry.tokens.worker,
        group=group,
        role=role,
        extra_env={"ENGINE_REGISTRY_TTL_S": "10"},
    )
    parts.instances.append(instance)
    instance.start()
    return instance


def workers(smg: SmgProcess) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in smg.workers()}


def complete(url: str, model: Path, limit_s: float = 180.0, wait_s: float = 0.0) -> str:
    """A greedy completion; a 503 (smg's policies not yet holding a worker it just listed as
    ready) is retried for ``wait_s``."""
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    deadline = time.monotonic() + wait_s
    while True:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=limit_s)
        if answer.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def nixl_lines(decode: GrpcInstance) -> str:
    """Decode's NIXL series as its /metrics shows them (for a failure's message)."""
    text = httpx.get(f"{decode.metrics_url}/metrics", timeout=30).text
    return "\n".join(line for line in text.splitlines() if "nixl" in line)[-3000:]


def ready(smg: SmgProcess, *urls: str) -> bool:
    now = workers(smg)
    return all(u in now and now[u].get("status") == "ready" for u in urls)


def generation(registry: Registry, group: str) -> int:
    answer = httpx.get(f"{registry.url}/tp-groups/{group}/engine", headers=registry.headers())
    return int(answer.json()["generation"]) if answer.status_code == 200 else 0


def other_dtype_prefill(registry: Registry, like: str, url: str) -> None:
    """A ready prefill group published as serving whose compat differs from ``like``'s in its
    dtype only (the registry's record, as a float16 launch would make it)."""
    headers = {"Authorization": f"Bearer {registry.tokens.worker}"}
    with httpx.Client(base_url=registry.url, headers=headers, timeout=10.0) as http:
        engine = http.get(f"/tp-groups/{like}/engine").json()
        serving = engine["serving"]
        compat = {**engine["compat"], "dtype": "float16"}
        body = {"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": "prefill", "compat": compat}
        other = http.put("/tp-groups/smg-prefill-f16/engine", json=body).json()
        agent = {
            "engine_id": other["engine_id"],
            "agent_name": "f16-0",
            "host": "127.0.0.1",
            "agent_metadata": base64.b64encode(b"md").decode(),
            "ttl_s": 600,
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [4096],
                "num_blocks": 8,
                "block_len": 64,
            },
        }
        assert http.put("/tp-groups/smg-prefill-f16/engine/agents/0", json=agent).is_success
        assert serving["url"].startswith("grpc://"), serving
        published = {"engine_id": other["engine_id"], "url": url, "model": serving["model"]}
        answer = http.put("/tp-groups/smg-prefill-f16/engine/serving", json=published)
        assert answer.status_code == 200, answer.text


def test_smg_fed_by_router_sync_serves_pd_and_drops_a_relaunched_prefill_within_a_second(
    vllm_workdir: Path, tiny_model: Path, registry: Registry, parts: Parts
) -> None:
    where = {"model": tiny_model, "workdir": vllm_workdir, "registry": registry}
    t0 = time.monotonic()
    prefill = launch(parts, "smg-prefill-1", "smg-prefill-0", "prefill", **where)
    decode = launch(parts, "smg-decode", "smg-decode-0", "decode", **where)
    prefill.wait_healthy(START_S)
    decode.wait_healthy(START_S)
    FIGURES["gRPC prefill and decode serving after"] = time.monotonic() - t0
    smg = SmgProcess(vllm_workdir, model_path=tiny_model)
    parts.others.append(smg.start())
    sync = RouterSyncProcess(
        vllm_workdir, registry.url, [], token=registry.tokens.reader, smgs=[smg]
    )
    parts.others.append(sync.start())
    f16 = "grpc://127.0.0.1:1"

    def listed(*urls: str) -> bool:
        now = workers(smg)
        assert f16 not in now, now[f16]  # never registered
        return all(u in now for u in urls)

    deadline = time.monotonic() + 120
    while not listed(prefill.grpc_url, decode.grpc_url):
        assert time.monotonic() < deadline, (sync.log_text()[-3000:], smg.workers())
        time.sleep(0.2)
    other_dtype_prefill(registry, "smg-prefill-0", f16)
    engines = {g: registry_engine(registry, g) for g in ("smg-prefill-0", "smg-decode-0")}
    now = workers(smg)
    assert now[prefill.grpc_url]["worker_type"] == "prefill"
    assert now[prefill.grpc_url]["kv_engine_id"] == engines["smg-prefill-0"]
    assert now[decode.grpc_url]["kv_engine_id"] == engines["smg-decode-0"]
    deadline = time.monotonic() + 10
    while "not registering smg-prefill-f16: incompatible: dtype" not in sync.log_text():
        assert time.monotonic() < deadline, sync.log_text()[-3000:]
        listed()
        time.sleep(0.2)

    # PD through smg (NIXL reads on decode) with the prefill's own greedy text.
    deadline = time.monotonic() + 60
    while not ready(smg, prefill.grpc_url, decode.grpc_url):
        assert time.monotonic() < deadline, smg.workers()
        time.sleep(0.2)
    reads = nixl_transfers(decode.metrics_url)
    through_smg = complete(smg.url, tiny_model, wait_s=30)
    assert nixl_transfers(decode.metrics_url) > reads, nixl_lines(decode)
    alone = SmgProcess(vllm_workdir, model_path=tiny_model, pd=False, name="smg-prefill-alone")
    parts.others.append(alone.start())
    alone.register({"url": prefill.grpc_url, "connection_mode": "grpc", "runtime_type": "vllm"})
    assert complete(alone.url, tiny_model, wait_s=120) == through_smg
    alone.stop()

    # The prefill relaunched on another port: smg's own list drops the old one within 1 s
    # of the registry's new generation, from the last look that still saw the old one.
    before = generation(registry, "smg-prefill-0")
    relaunched = launch(parts, "smg-prefill-2", "smg-prefill-0", "prefill", **where)
    last_old = time.monotonic()
    while generation(registry, "smg-prefill-0") == before:
        assert time.monotonic() - last_old < START_S, relaunched.tails()
        last_old = time.monotonic()
        time.sleep(0.02)
    while listed(prefill.grpc_url):
        assert time.monotonic() - last_old < 5.0, (sync.log_text()[-3000:], smg.workers())
        time.sleep(0.02)
    removal_s = time.monotonic() - last_old
    FIGURES["superseded prefill out of smg's list after"] = removal_s
    assert removal_s < 1.0, removal_s
    # router-sync writes its withdrawal line after smg has answered its DELETE: smg's list
    # may show the worker gone before the line is written (the machine's cores are loaded).
    deadline = time.monotonic() + 5
    while "superseded by generation" not in sync.log_text():
        assert time.monotonic() < deadline, (sync.log_text()[-3000:], smg.workers())
        time.sleep(0.05)
    relaunched.wait_healthy(START_S)
    prefill.stop()
    deadline = time.monotonic() + 120
    while not listed(relaunched.grpc_url) or not ready(smg, relaunched.grpc_url):
        assert time.monotonic() < deadline, (sync.log_text()[-3000:], smg.workers())
        time.sleep(0.2)
    new_engine = registry_engine(registry, "smg-prefill-0")
    assert new_engine != engines["smg-prefill-0"]
    assert workers(smg)[relaunched.grpc_url]["kv_engine_id"] == new_engine
    reads = nixl_transfers(decode.metrics_url)
    for _ in range(2):  # smg was never restarted
        assert complete(smg.url, tiny_model, wait_s=30) == through_smg
    assert nixl_transfers(decode.metrics_url) >= reads + 2
    assert listed(relaunched.grpc_url)


def registry_engine(registry: Registry, group: str) -> str:
    answer = httpx.get(f"{registry.url}/tp-groups/{group}/engine", headers=registry.headers())
    return str(answer.json()["engine_id"])
