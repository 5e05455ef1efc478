"""The plugin's data-parallel identity and its PP check, on configs shaped as vLLM 0.32 leaves
them (no vLLM needed): a dense model's DP rank is an independent engine whose DP fields vLLM
reset, an MoE model's keeps them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from workers.vllm_plugin import common
from workers.vllm_plugin.pp_limit import BASE_LIMIT, pp_limit
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.unit


def config(engine_id: str, size: int, rank: int, index: int | None) -> Any:
    parallel = SimpleNamespace(data_parallel_size=size, data_parallel_rank=rank)
    if index is not None:
        parallel.data_parallel_index = index
    return SimpleNamespace(
        parallel_config=parallel, kv_transfer_config=SimpleNamespace(engine_id=engine_id)
    )


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> PluginSettings:
    monkeypatch.setenv("ENGINE_REGISTRY_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("ENGINE_REGISTRY_GROUP", "prefill")
    return PluginSettings.from_env()


def test_a_dense_models_dp_rank_is_found_after_vllm_reset_its_dp_fields(
    settings: PluginSettings,
) -> None:
    # vLLM's engine core appended `_dp1`, then reconfigure_for_independent_dp_rank() set
    # size 1 and rank 0: only data_parallel_index and the suffix say which rank this is.
    reset = config("5b0c1f7e_dp1", 1, 0, 1)
    assert common.group_id(reset, settings) == ("prefill-dp1", 1)
    assert common.group_id(config("5b0c1f7e_dp0", 1, 0, 0), settings) == ("prefill-dp0", 0)
    # The plugin's own id on a second connector of the same worker keeps the rank.
    assert common.group_id(config("registry-id_dp1", 1, 0, 1), settings) == ("prefill-dp1", 1)


def test_an_moe_models_dp_rank_and_no_dp_at_all(settings: PluginSettings) -> None:
    assert common.group_id(config("5b0c1f7e_dp3", 4, 3, 3), settings) == ("prefill-dp3", 3)
    assert common.group_id(config("5b0c1f7e", 1, 0, 0), settings) == ("prefill", None)
    assert common.group_id(config("5b0c1f7e", 1, 0, None), settings) == ("prefill", None)
    assert common.vllm_engine_id("abc", None) == "abc"
    assert common.vllm_engine_id("abc", 1) == "abc_dp1"


class Base:
    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        raise ValueError("received pp_rank > 0 handshake metadata")


class Inherits(Base):
    pass


class Overrides(Base):
    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        return None


def test_pp_with_a_connector_vllm_gives_no_pp_handshake_is_refused_naming_the_limit() -> None:
    reason = pp_limit(Inherits, Base, 2)
    assert reason is not None
    assert "Inherits does not support PP-disaggregated KV transfer" in reason
    assert BASE_LIMIT in reason
    assert "pipeline_parallel_size 2" in reason
    assert pp_limit(Inherits, Base, 1) is None
    assert pp_limit(Overrides, Base, 4) is None
