"""The entrypoints read their registry settings from the environment, as compose gives them:
one settings class per entrypoint (`workers.settings`), every field a variable and a flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import prefill
from workers.settings import PrefillSettings

pytestmark = pytest.mark.workers


def parse(argv: list[str]) -> PrefillSettings:
    return prefill.parse_args(argv)


def test_group_id_and_token_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKERS_GROUP_ID", "prefill-7")
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN", "t" * 20)
    args = parse([])
    assert (args.group_id, args.registry_token) == ("prefill-7", "t" * 20)


def test_token_file_is_read_when_no_token_variable_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    secret.write_text("s" * 24 + "\n")
    monkeypatch.delenv("WORKERS_REGISTRY_TOKEN", raising=False)
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN_FILE", str(secret))
    assert parse(["--group-id", "g"]).registry_token == "s" * 24


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKERS_GROUP_ID", "from-env")
    assert parse(["--group-id", "from-flag"]).group_id == "from-flag"


def test_group_id_is_required_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKERS_GROUP_ID", raising=False)
    with pytest.raises(SystemExit):
        parse([])


def test_an_unreadable_token_file_stops_with_its_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORKERS_REGISTRY_TOKEN", raising=False)
    monkeypatch.setenv("WORKERS_REGISTRY_TOKEN_FILE", "/nonexistent/token")
    with pytest.raises(SystemExit) as info:
        parse(["--group-id", "g"])
    assert info.value.code == 2
    assert "WORKERS_REGISTRY_TOKEN_FILE /nonexistent/token" in capsys.readouterr().err


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
    err = capsys.readouterr().err
    assert "WORKERS_PUBLISH='per-host'" in err
    assert "'per-node' or 'per-rank'" in err
    monkeypatch.delenv("WORKERS_PUBLISH")
    with pytest.raises(SystemExit):
        parse(["--group-id", "g", "--publish", "per-pod"])


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--ttl-s", "2"], {}, "--ttl-s='2': Input should be greater than or equal to 5"),
        ([], {"WORKERS_TTL_S": "30s"}, "WORKERS_TTL_S='30s'"),
        (["--num-blocks", "many"], {}, "--num-blocks='many'"),
        ([], {"WORKERS_DEVICE": ""}, None),  # empty: unset, the default holds
    ],
)
def test_a_bad_value_names_the_flag_or_variable_the_value_and_the_form(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    named: str | None,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if named is None:
        assert parse(["--group-id", "g", *argv]).device == "cpu"
        return
    with pytest.raises(SystemExit) as info:
        parse(["--group-id", "g", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert "expected " in err
