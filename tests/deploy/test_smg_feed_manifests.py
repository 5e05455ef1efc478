"""compose's `routers` profile and deploy/k8s's router-sync Deployment feed smg gateways too:
the URLs and the admin key come from the environment (ROUTER_SYNC_SMG, SMG_API_KEY), empty by
default (no smg fed), and the command router-sync is started with takes them."""

from __future__ import annotations

from typing import Any

import pytest

from app.cli import build_parser
from tests.deploy.test_k8s_manifests import rendered
from tests.deploy.test_k8s_router_sync import router_sync
from tests.docker.compose_support import load_services
from tests.docker.test_compose import OPERATOR_ENV

pytestmark = pytest.mark.deploy
__all__ = ["rendered"]


def smg_urls(command: list[str], environment: dict[str, str], mp: pytest.MonkeyPatch) -> Any:
    """The --smg list router-sync would run with, under that environment."""
    for name in ("ROUTER_SYNC_SMG", "SMG_API_KEY"):
        mp.setenv(name, environment.get(name, ""))
    args = build_parser().parse_args(command[1:])
    return args.smg, args.smg_api_key


def test_compose_feeds_the_smg_gateways_its_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**OPERATOR_ENV, "READER_TOKEN": "reader-token-0123456789"}
    sync = load_services(env, profiles=["routers"])["router-sync"]
    assert smg_urls(sync.command, sync.environment, monkeypatch) == ([], None)
    env = {**env, "SMG_URLS": "http://smg:30000,http://smg-b:30000", "SMG_API_KEY": "k-1"}
    sync = load_services(env, profiles=["routers"])["router-sync"]
    got = smg_urls(sync.command, sync.environment, monkeypatch)
    assert got == (["http://smg:30000", "http://smg-b:30000"], "k-1")


def test_the_k8s_deployment_feeds_no_smg_until_told_and_reads_its_key_from_a_secret(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for objects in rendered.values():
        container = router_sync(objects)
        env = {e["name"]: e for e in container["env"]}
        assert env["ROUTER_SYNC_SMG"]["value"] == ""
        ref = env["SMG_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "smg-admin-key", "key": "key", "optional": True}
        told = {"ROUTER_SYNC_SMG": "http://smg:30000"}
        assert smg_urls(container["command"], told, monkeypatch) == (["http://smg:30000"], None)
