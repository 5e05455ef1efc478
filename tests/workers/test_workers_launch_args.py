"""The entrypoints read their registry settings from the environment, as compose gives them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from workers.launch import add_common_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    return parser.parse_args(argv)


def test_group_id_and_token_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKERS_GROUP_ID", "prefill-7")
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN", "t" * 20)
    args = parse([])
    assert (args.group_id, args.token) == ("prefill-7", "t" * 20)


def test_token_file_is_read_when_no_token_variable_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    secret.write_text("s" * 24 + "\n")
    monkeypatch.delenv("WORKERS_REGISTRY_TOKEN", raising=False)
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN_FILE", str(secret))
    assert parse(["--group-id", "g"]).token == "s" * 24


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKERS_GROUP_ID", "from-env")
    assert parse(["--group-id", "from-flag"]).group_id == "from-flag"


def test_group_id_is_required_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKERS_GROUP_ID", raising=False)
    with pytest.raises(SystemExit):
        parse([])


def test_an_unreadable_token_file_stops_with_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKERS_REGISTRY_TOKEN", raising=False)
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN_FILE", "/nonexistent/token")
    with pytest.raises(SystemExit, match="/nonexistent/token"):
        parse(["--group-id", "g"])


def test_publication_is_per_node_unless_the_flag_or_variable_says_per_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WORKERS_PUBLISH", raising=False)
    assert parse(["--group-id", "g"]).publish == "per-node"
    assert parse(["--group-id", "g", "--publish", "per-rank"]).publish == "per-rank"
    monkeypatch.setenv("WORKERS_PUBLISH", "per-rank")
    assert parse(["--group-id", "g"]).publish == "per-rank"
    assert parse(["--group-id", "g", "--publish", "per-node"]).publish == "per-node"


def test_an_unknown_publication_mode_stops_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORKERS_PUBLISH", "per-host")
    with pytest.raises(SystemExit):
        parse(["--group-id", "g"])
    assert "per-node, per-rank" in capsys.readouterr().err
    monkeypatch.delenv("WORKERS_PUBLISH")
    with pytest.raises(SystemExit):
        parse(["--group-id", "g", "--publish", "per-pod"])
