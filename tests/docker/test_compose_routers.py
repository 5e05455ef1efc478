"""docker/compose.yaml's `routers` profile: router-sync, parsed by a real compose parser, with a
command `engine-registry router-sync` accepts and the reader token from the environment."""

from __future__ import annotations

import pytest

from app.cli import build_parser
from tests.docker.compose_support import load_services
from tests.docker.test_compose import OPERATOR_ENV, compose, needs_compose

pytestmark = pytest.mark.deploy


@needs_compose
def test_the_routers_profile_parses() -> None:
    run = compose("--profile", "routers", "config", "-q", env=OPERATOR_ENV)
    assert run.returncode == 0, run.stderr


def test_router_sync_follows_the_registry_service_with_the_reader_token() -> None:
    services = load_services(
        {**OPERATOR_ENV, "READER_TOKEN": "reader-token-0123456789"}, profiles=["routers"]
    )
    sync = services["router-sync"]
    assert sync.command[:2] == ["engine-registry", "router-sync"], sync.command
    args = build_parser().parse_args(sync.command[1:])
    assert args.vllm_router == ["vllm-router:30001"]
    assert sync.environment["REGISTRY_URL"] == "http://registry:8080"
    assert sync.environment["REGISTRY_TOKEN"] == "reader-token-0123456789"
    # Not in the default deployment: the router is the operator's.
    assert "router-sync" not in load_services(OPERATOR_ENV)
