from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.security.auth import TokenFileError, parse_tokens, required_role, role_of
from app.server.settings import Settings

pytestmark = pytest.mark.unit

READER = "r" * 20
WORKER = "w" * 20


def test_token_lines_map_tokens_to_roles_and_skip_comments() -> None:
    text = f"# the fleet\nreader:{READER}\n\nworker:{WORKER}  # rank tokens\n"
    tokens = parse_tokens(text, source="t")
    assert {role_of(tokens, t) for t in (READER, WORKER)} == {"reader", "worker"}
    assert len(tokens) == 2


@pytest.mark.parametrize("line", ["reader", "root:" + "x" * 20, "reader:short", "worker:"])
def test_bad_token_lines_name_the_line_but_not_the_token(line: str) -> None:
    with pytest.raises(TokenFileError, match="line 2") as info:
        parse_tokens(f"# ok\n{line}\n", source="tokens.txt")
    assert "x" * 20 not in str(info.value)


def test_role_lookup_matches_whole_tokens_only() -> None:
    tokens = parse_tokens(f"worker:{WORKER}", source="t")
    assert role_of(tokens, WORKER) == "worker"
    assert role_of(tokens, WORKER[:-1]) is None
    assert role_of(tokens, "") is None


@pytest.mark.parametrize(
    ("method", "path", "role"),
    [
        ("GET", "/healthz", None),
        ("GET", "/metrics", None),
        ("GET", "/tp-groups", "reader"),
        ("GET", "/engines/x", "reader"),
        ("PUT", "/tp-groups/g/engine", "worker"),
        ("POST", "/engines/x/handshake", "worker"),
        ("DELETE", "/tp-groups/g/engine/agents/0", "worker"),
        ("DELETE", "/tp-groups/g", "admin"),
    ],
)
def test_each_route_needs_the_contracts_role(method: str, path: str, role: str | None) -> None:
    assert required_role(method, path) == role


def test_settings_refuse_a_non_loopback_address_without_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REGISTRY_TOKENS", raising=False)
    with pytest.raises(ValidationError, match="tokens"):
        Settings(host="0.0.0.0")


def test_settings_accept_a_non_loopback_address_with_tokens_or_insecure(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin:{WORKER}\n")
    in_force = Settings(host="0.0.0.0", tokens_file=tokens).auth_tokens()
    assert role_of(in_force, WORKER) == "admin"
    assert len(in_force) == 1
    assert Settings(host="0.0.0.0", insecure=True).insecure


def test_settings_read_registry_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGISTRY_PORT", "9123")
    monkeypatch.setenv("REGISTRY_STORE", "sqlite:///x.db")
    settings = Settings()
    assert (settings.port, settings.store) == (9123, "sqlite:///x.db")
