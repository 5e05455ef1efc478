"""The one settings-to-flags bridge (``registry_client.settings_flags``), which both
``engine-registry serve`` and the workers' entry points build their flags with."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

import app.cli
from app.server.settings import Settings
from registry_client import settings_flags
from workers import config

pytestmark = pytest.mark.unit


class Example(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXAMPLE_")

    group_id: str = Field(description="a group id")
    ttl_s: int = Field(30, description="seconds")
    verbose: bool = Field(False, description="say more")


def _parser(**kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example")
    settings_flags.add_flags(parser, Example, {"ttl_s": ["--ttl"]}, **kwargs)
    return parser


def test_one_flag_a_field_aliases_first_and_only_what_was_given() -> None:
    args = _parser().parse_args(["--group-id", "g", "--ttl", "5", "--no-verbose"])
    assert settings_flags.given(args, Example) == {"group_id": "g", "ttl_s": "5", "verbose": False}
    assert settings_flags.given(_parser().parse_args([]), Example) == {}
    assert settings_flags.flag_names("ttl_s", {"ttl_s": ["--ttl"]}) == ["--ttl", "--ttl-s"]
    assert settings_flags.flag_names("ttl_s", {"ttl_s": ["--ttl-s", "--ttl"]}) == [
        "--ttl-s",
        "--ttl",
    ]


def test_the_help_names_the_variable_and_default() -> None:
    text = " ".join(_parser().format_help().split())
    assert "a group id ($EXAMPLE_GROUP_ID, default required)" in text
    assert "--ttl V, --ttl-s V seconds ($EXAMPLE_TTL_S, default 30)" in text
    plain = " ".join(_parser(env_shown="{}").format_help().split())
    assert "say more (EXAMPLE_VERBOSE, default False)" in plain


def test_the_service_and_the_workers_use_the_one_bridge(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.add_flags is settings_flags.add_flags
    assert config.flag_names is settings_flags.flag_names
    calls: list[type[BaseSettings]] = []
    real = settings_flags.add_flags

    def recording(
        parser: argparse.ArgumentParser, cls: type[BaseSettings], *a: Any, **k: Any
    ) -> None:
        calls.append(cls)
        real(parser, cls, *a, **k)

    monkeypatch.setattr(settings_flags, "add_flags", recording)
    parser = argparse.ArgumentParser()
    app.cli.add_settings_flags(parser)
    assert calls == [Settings]
    args = parser.parse_args(["--store-timeout", "2.5", "--no-fast-path"])
    assert settings_flags.given(args, Settings) == {"store_timeout_s": "2.5", "fast_path": False}
