"""deploy/k8s's router-sync Deployment, rendered by `kubectl kustomize`: its command is one
`engine-registry router-sync` accepts, it reads with the reader token of the tokens file, and
in the TLS overlay it reaches the registry over HTTPS trusting the registry's CA."""

from __future__ import annotations

from typing import Any

import pytest

from app.cli import build_parser
from tests.deploy import k8s_support as k8s
from tests.deploy.test_k8s_manifests import TOKENS, rendered

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(120)]
__all__ = ["rendered"]


def router_sync(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [deployment] = [o for o in objects if o["kind"] == "Deployment"
                    and o["metadata"]["name"].endswith("router-sync")]  # fmt: skip
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_router_sync_reads_the_registry_with_the_reader_token(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    container = router_sync(objects)
    command = container["command"]
    assert command[:2] == ["engine-registry", "router-sync"], command
    args = build_parser().parse_args(command[1:])
    assert args.vllm_router == ["vllm-router:30001"]
    env = {e["name"]: e for e in container["env"]}
    ref = env["REGISTRY_TOKEN"]["valueFrom"]["secretKeyRef"]
    token = k8s.secret_value(objects, ref["name"], ref["key"]).strip()
    assert token == TOKENS["reader"]
    tokens = k8s.secret_value(
        objects, k8s.secret_named(objects, "engine-registry-tokens")["metadata"]["name"], "tokens"
    )
    assert f"reader:{token}" in tokens.splitlines()
    scheme = "https" if overlay == "tls" else "http"
    assert env["REGISTRY_URL"]["value"] == f"{scheme}://engine-registry:8080"
    if overlay == "tls":
        assert env["REGISTRY_CA"]["value"] == "/run/secrets/engine-registry-ca/ca.crt"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/run/secrets/engine-registry-ca" in mounts
