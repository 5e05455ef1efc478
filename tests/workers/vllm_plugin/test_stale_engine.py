"""A handshake with a prefill engine the registry says is gone fails at once
(workers.vllm_plugin.stale), against a real registry process; vLLM's NIXL worker is a stand-in
here (an object with `_nixl_handshake`), the real one runs in the vLLM tier."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.server import RegistryProcess, free_port
from registry_client.client import RegistryClient
from workers.vllm_plugin.settings import PluginSettings
from workers.vllm_plugin.stale import StaleRemoteEngine, guard, verdict

pytestmark = pytest.mark.api


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("stale")
    with RegistryProcess(f"sqlite:///{Path(d) / 'r.db'}", log_path=Path(d) / "r.log") as proc:
        yield proc


class StandInWorker:
    """What the guard wraps: vLLM's NIXL worker's `_nixl_handshake` (records its calls)."""

    def __init__(self) -> None:
        self.dialed: list[tuple[str, int, str]] = []

    def _nixl_handshake(self, host: str, port: int, tp: int, engine_id: str) -> str:
        self.dialed.append((host, port, engine_id))
        return "handshaked"


def test_superseded_and_unknown_engines_fail_without_dialing(registry: RegistryProcess) -> None:
    with RegistryClient(registry.url) as client:
        old, _ = client.open_engine("p", launch_id=uuid.uuid4().hex, tp_size=1, role="prefill")
        new, _ = client.open_engine("p", launch_id=uuid.uuid4().hex, tp_size=1, role="prefill")
        assert verdict(client, new.engine_id) is None
        assert verdict(client, f"{new.engine_id}_dp0") is None  # vLLM's DP suffix
        why = verdict(client, old.engine_id)
        assert why is not None
        assert f"superseded by generation 2 (engine {new.engine_id})" in why
        unknown = verdict(client, str(uuid.uuid4()))
        assert unknown is not None
        assert "unknown to the registry" in unknown
    worker = StandInWorker()
    assert guard(worker, PluginSettings(url=registry.url, group="d"))
    t0 = time.monotonic()
    with pytest.raises(StaleRemoteEngine, match="superseded"):
        worker._nixl_handshake("127.0.0.1", 5600, 1, old.engine_id)
    print(f"refused in {time.monotonic() - t0:.3f} s")
    assert worker.dialed == []
    assert worker._nixl_handshake("127.0.0.1", 5601, 1, new.engine_id) == "handshaked"
    assert worker.dialed == [("127.0.0.1", 5601, new.engine_id)]


def test_without_an_answer_vllm_decides() -> None:
    worker = StandInWorker()
    dead = f"http://127.0.0.1:{free_port()}"
    guard(worker, PluginSettings(url=dead, group="d"))
    t0 = time.monotonic()
    assert worker._nixl_handshake("127.0.0.1", 5600, 1, "any-engine") == "handshaked"
    assert time.monotonic() - t0 < 5  # bounded by the check's 1 s deadline, not a hang


def test_a_worker_without_a_nixl_handshake_is_left_alone() -> None:
    other: Any = object()
    assert guard(other, PluginSettings(url="http://127.0.0.1:1", group="d")) is False
