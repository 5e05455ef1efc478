"""The plugin's pieces that need no vLLM: dormancy, the version gate, settings, DP ids, and
the first process's token check (against a scripted HTTP server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from workers import vllm_plugin
from workers.vllm_plugin import common, hook
from workers.vllm_plugin.resolve import split_dp_suffix
from workers.vllm_plugin.settings import PluginConfigError, PluginSettings

pytestmark = pytest.mark.unit


def test_dormant_without_a_registry_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_REGISTRY_URL", raising=False)
    assert not vllm_plugin.active()
    # In a fresh interpreter: register() imports neither the hooks nor vLLM, and changes no
    # environment variable.
    probe = (
        "import os, sys; before = dict(os.environ);"
        "import workers.vllm_plugin as p; p.register();"
        "bad = sorted(m for m in sys.modules"
        " if m.startswith(('vllm', 'workers.vllm_plugin.', 'workers.identity', 'torch'))"
        " and m != 'workers.vllm_plugin.activation');"
        "changed = sorted(k for k in set(before) | set(os.environ)"
        " if before.get(k) != os.environ.get(k));"
        "print(bad, changed); sys.exit(1 if bad or changed else 0)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_REGISTRY_")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


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
    with pytest.raises(PluginConfigError, match="ENGINE_REGISTRY_GROUP"):
        PluginSettings.from_env()
    monkeypatch.setenv("ENGINE_REGISTRY_GROUP", "prefill-0")
    monkeypatch.setenv("ENGINE_REGISTRY_ROLE", "producer")
    with pytest.raises(PluginConfigError, match="prefill, decode or both"):
        PluginSettings.from_env()
    monkeypatch.setenv("ENGINE_REGISTRY_ROLE", "decode")
    settings = PluginSettings.from_env()
    assert (settings.group, settings.role, settings.ttl_s) == ("prefill-0", "decode", 30)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("ENGINE_REGISTRY_TTL_S", "30s", "whole seconds, 5-3600"),
        ("ENGINE_REGISTRY_TTL_S", "2", "greater than or equal to 5"),
        ("ENGINE_REGISTRY_TIMEOUT_S", "soon", "seconds > 0"),
        ("ENGINE_REGISTRY_REFUSE_EXIT_S", "-1", ">= 0"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_the_form_expected(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv("ENGINE_REGISTRY_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("ENGINE_REGISTRY_GROUP", "prefill-0")
    monkeypatch.setenv(variable, value)
    with pytest.raises(PluginConfigError) as info:
        PluginSettings.from_env()
    message = str(info.value)
    assert f"{variable}={value!r}" in message
    assert expected in message


def test_the_token_may_come_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENGINE_REGISTRY_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("ENGINE_REGISTRY_GROUP", "prefill-0")
    monkeypatch.delenv("ENGINE_REGISTRY_TOKEN", raising=False)
    secret = tmp_path / "token"
    secret.write_text("w" * 24 + "\n")
    monkeypatch.setenv("ENGINE_REGISTRY_TOKEN_FILE", str(secret))
    assert PluginSettings.from_env().token == "w" * 24
    monkeypatch.setenv("ENGINE_REGISTRY_TOKEN", "v" * 24)  # the variable wins over the file
    assert PluginSettings.from_env().token == "v" * 24
    monkeypatch.delenv("ENGINE_REGISTRY_TOKEN")
    monkeypatch.setenv("ENGINE_REGISTRY_TOKEN_FILE", "/nonexistent/token")
    with pytest.raises(PluginConfigError, match="ENGINE_REGISTRY_TOKEN_FILE /nonexistent/token"):
        PluginSettings.from_env()


def test_data_parallel_ids_follow_vllms_suffix() -> None:
    assert common.vllm_engine_id("abc", None) == "abc"
    assert common.vllm_engine_id("abc", 2) == "abc_dp2"
    assert split_dp_suffix("abc_dp2") == ("abc", 2)
    assert split_dp_suffix("5b0c1f7e-2a55-4d8e-9d0e-0f6c3f1b8a11") == (
        "5b0c1f7e-2a55-4d8e-9d0e-0f6c3f1b8a11",
        None,
    )


class _Answer(BaseHTTPRequestHandler):
    status = 401

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        code = {401: "unauthorized", 404: "not_found"}[self.status]
        body = json.dumps(
            {
                "title": "t",
                "status": self.status,
                "code": code,
                "detail": "A valid bearer token is required",
            }
        ).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/problem+json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("status", [401, 404])
def test_the_first_process_refuses_a_token_the_registry_refuses(status: int) -> None:
    handler = type("Answer", (_Answer,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = PluginSettings(
        url=f"http://127.0.0.1:{server.server_port}",
        group="g",
        token="wrong-token-xxxxxxxx",
        timeout_s=5,
        launch_id="l",
    )
    try:
        if status == 404:  # no engine yet: the token was accepted, nothing to refuse
            hook.check_token(settings)
            return
        with pytest.raises(PluginConfigError) as info:
            hook.check_token(settings)
        for words in ("refuses to start: unauthorized", "ENGINE_REGISTRY_TOKEN", "worker role"):
            assert words in str(info.value)
    finally:
        server.shutdown()
        server.server_close()
