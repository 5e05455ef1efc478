"""The plugin's Mooncake part without vLLM (workers/vllm_plugin/mooncake.py): which registry
URL vLLM's bootstrap client can use, and what a decode asks for a DP rank's engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers.vllm_plugin import mooncake
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.unit


def settings(url: str, token: str | None = None) -> PluginSettings:
    return PluginSettings(url=url, group="prefill-m", token=token)


def test_only_a_plain_http_registry_without_a_token_is_pointed_at() -> None:
    assert mooncake.registry_url(settings("http://reg:8080/, http://reg2:8080")) == (
        "http://reg:8080"
    )
    assert mooncake.registry_url(settings("https://reg:8443")) is None  # vLLM posts http://
    assert mooncake.registry_url(settings("http://reg:8080", token="t")) is None  # no header


def test_a_prefill_is_pointed_at_the_registry_unless_the_launch_named_a_server() -> None:
    def config(extra: dict[str, str]) -> SimpleNamespace:
        kv = SimpleNamespace(kv_connector="MooncakeConnector", kv_connector_extra_config=extra)
        return SimpleNamespace(kv_transfer_config=kv)

    plain = config({})
    assert mooncake.is_mooncake(plain)
    mooncake.point_prefill(plain, settings("http://10.0.0.5:8080"))
    assert plain.kv_transfer_config.kv_connector_extra_config == {
        "bootstrap_server_address": "10.0.0.5:8080"
    }
    given = config({"bootstrap_server_address": "10.0.0.9:8998"})
    mooncake.point_prefill(given, settings("http://10.0.0.5:8080"))
    assert given.kv_transfer_config.kv_connector_extra_config == {
        "bootstrap_server_address": "10.0.0.9:8998"
    }
    refused = config({})
    mooncake.point_prefill(refused, settings("http://10.0.0.5:8080", token="t"))
    assert refused.kv_transfer_config.kv_connector_extra_config == {}


def test_a_dp_ranks_engine_is_asked_by_its_registry_id() -> None:
    assert mooncake.bootstrap_of("http://r:1", "abc_dp3") == "http://r:1/mooncake/abc"
    assert mooncake.bootstrap_of("http://r:1", "g~l") == "http://r:1/mooncake/g~l"
