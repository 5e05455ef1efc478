"""router-sync feeds vllm-router over ZMQ carrying msgpack: the ``router-sync`` extra, not the
service's dependencies. Without it, ``--vllm-router`` is refused at once naming the extra;
``--smg`` alone (plain HTTP) needs neither."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from app.cli import build_parser
from registry_client.router_sync import cli

pytestmark = pytest.mark.unit


def without(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == module else real(name, package)

    monkeypatch.setattr(cli.importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("module", ["zmq", "msgpack"])
def test_vllm_router_without_the_extra_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: str
) -> None:
    without(monkeypatch, module)
    args = build_parser().parse_args(["router-sync", "--vllm-router", "127.0.0.1:7000"])
    assert args.func(args) == 2
    said = capsys.readouterr().err
    assert f"--vllm-router needs {module}" in said
    assert "from the checkout: .venv/bin/pip install -e '.[router-sync]'" in said


def test_the_extra_is_not_asked_of_smg_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    without(monkeypatch, "zmq")
    assert cli._missing_extra() == "zmq"
    args = build_parser().parse_args(["router-sync", "--smg", "not-a-url"])
    assert args.func(args) == 2  # refused for its URL only, not for the extra
    said = capsys.readouterr().err
    assert "is not http(s)://host:port" in said
    assert "router-sync]" not in said
