"""The plugin's pieces that need no vLLM: dormancy, the version gate, settings, DP ids."""

from __future__ import annotations

import pytest

from workers import vllm_plugin
from workers.vllm_plugin import hook
from workers.vllm_plugin.resolve import split_dp_suffix


def test_dormant_without_a_registry_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_REGISTRY_URL", raising=False)
    assert not vllm_plugin.active()
    vllm_plugin.register()  # returns without importing vLLM or touching anything


def test_an_unsupported_vllm_fails_naming_the_supported_versions() -> None:
    hook.check_version("0.32.0")
    hook.check_version("0.32.0+cpu")
    with pytest.raises(hook.UnsupportedVllm) as info:
        hook.check_version("0.31.1")
    message = str(info.value)
    assert "0.31.1" in message
    assert "0.32.0" in message
    assert "ENGINE_REGISTRY_URL" in message


def test_active_without_a_group_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_REGISTRY_URL", "http://127.0.0.1:1")
    monkeypatch.delenv("ENGINE_REGISTRY_GROUP", raising=False)
    monkeypatch.setenv("ENGINE_REGISTRY_LAUNCH_ID", "x")
    with pytest.raises(hook.PluginConfigError, match="ENGINE_REGISTRY_GROUP"):
        hook.Settings.from_env()
    monkeypatch.setenv("ENGINE_REGISTRY_GROUP", "prefill-0")
    monkeypatch.setenv("ENGINE_REGISTRY_ROLE", "producer")
    with pytest.raises(hook.PluginConfigError, match="prefill, decode or both"):
        hook.Settings.from_env()
    monkeypatch.setenv("ENGINE_REGISTRY_ROLE", "decode")
    settings = hook.Settings.from_env()
    assert (settings.group, settings.role, settings.ttl_s) == ("prefill-0", "decode", 30)


def test_data_parallel_ids_follow_vllms_suffix() -> None:
    assert hook._vllm_engine_id("abc", 1, 0) == "abc"
    assert hook._vllm_engine_id("abc", 4, 2) == "abc_dp2"
    assert split_dp_suffix("abc_dp2") == ("abc", 2)
    assert split_dp_suffix("5b0c1f7e-2a55-4d8e-9d0e-0f6c3f1b8a11") == (
        "5b0c1f7e-2a55-4d8e-9d0e-0f6c3f1b8a11",
        None,
    )
