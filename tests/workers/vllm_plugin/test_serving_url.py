"""Where the plugin says an instance serves (workers.vllm_plugin.serving), without vLLM: the
URL routers are told and the one the API server polls itself at, from its command line."""

from __future__ import annotations

from typing import Any

import pytest

from workers.vllm_plugin.serving import serving_urls, start
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.unit


def settings(**extra: Any) -> PluginSettings:
    return PluginSettings(url="http://127.0.0.1:8500", group="g", **extra)


@pytest.mark.parametrize(
    ("argv", "told", "polled"),
    [
        (
            ["serve", "m", "--host", "10.1.2.3", "--port", "8100"],
            "http://10.1.2.3:8100",
            "http://10.1.2.3:8100",
        ),
        (["serve", "m", "--port=8101"], "http://127.0.0.1:8101", "http://127.0.0.1:8101"),
        (["serve", "m", "--host", "0.0.0.0"], "http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        (
            ["serve", "m", "--host", "node-a.local", "--port", "9"],
            "http://node-a.local:9",
            "http://node-a.local:9",
        ),
    ],
)
def test_the_url_comes_from_the_command_line(argv: list[str], told: str, polled: str) -> None:
    # A wildcard or absent host is replaced by the address that routes to the registry
    # (loopback here: the registry is on loopback).
    assert serving_urls(settings(), argv) == (told, polled)


def test_an_advertised_url_wins_for_routers_but_the_api_is_polled_locally() -> None:
    got = serving_urls(settings(advertise_url="http://svc.ns:80/"), ["serve", "m", "--port", "7"])
    assert got == ("http://svc.ns:80", "http://127.0.0.1:7")


def test_a_headless_node_publishes_nothing() -> None:
    assert start(settings(), ["serve", "m", "--headless"]) is None
