"""deploy/k8s's router-sync Deployment, rendered by `kubectl kustomize`: its command is one
`engine-registry router-sync` accepts, it reads with the reader token of the tokens file, and
in the TLS overlay it reaches the registry over HTTPS trusting the registry's CA. Its probes,
run as the kubelet would against a real router-sync following a real registry: they pass
while it sees the registry and fail once it has been blind past its grace."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import build_parser
from harness.server import RegistryProcess, free_port
from tests.deploy import k8s_support as k8s
from tests.deploy.test_k8s_manifests import TOKENS, rendered
from workers.tools.routers import RouterSyncProcess

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(120)]
__all__ = ["rendered"]


def router_sync(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [deployment] = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("router-sync")
    ]
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


def probes() -> dict[str, list[str]]:
    """The router-sync container's exec probes as deploy/k8s ships them."""
    deployment = yaml.safe_load((k8s.K8S / "base" / "router-sync-deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--alive-file=/tmp/router-sync.alive" in container["command"]
    return {
        kind: container[f"{kind}Probe"]["exec"]["command"]
        for kind in ("startup", "liveness", "readiness")
    }


def passes(command: list[str], alive: Path) -> bool:
    """The probe's own command, run as the kubelet would, on this test's alive file."""
    argv = [arg.replace("/tmp/router-sync.alive", str(alive)) for arg in command]
    return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0


def wait_for(check: Callable[[], bool], within_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within_s, f"{what}: not within {within_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_the_shipped_probes_pass_while_router_sync_sees_and_fail_once_it_is_blind(
    tmp_path: Path,
) -> None:
    commands = probes()
    alive = tmp_path / "router-sync.alive"
    grace_s = 3.0
    env = {"REGISTRY_WATCH_BOOKMARK_S": "1"}  # a quiet registry says it is there every 1 s
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'r.db'}", env=env, log_path=tmp_path / "registry.log"
    ) as registry:
        sync = RouterSyncProcess(tmp_path, registry.url, [f"127.0.0.1:{free_port()}"])
        sync.cmd += ["--alive-file", str(alive), "--grace", str(grace_s)]
        try:
            assert not any(passes(c, alive) for c in commands.values())  # no file yet
            sync.start()
            wait_for(alive.exists, 30, f"router-sync touches {alive}")
            for kind, command in commands.items():
                assert passes(command, alive), kind

            # The registry goes: past the grace, one line with the cause; the file ages out.
            registry.stop()
            wait_for(lambda: "past the 3 s grace" in sync.log_text(), grace_s + 15, "blind")
            blind = sync.log_text()
            assert "ConnectError" in blind or "no registry answered" in blind, blind[-2000:]
            wait_for(lambda: not passes(commands["readiness"], alive), 5 + 3, "not ready")
            wait_for(lambda: not passes(commands["liveness"], alive), 15 + 3, "not alive")
            assert not passes(commands["startup"], alive)
            assert sync.log_text().count("past the 3 s grace") == 1

            # The registry comes back: the watch is back and the probes pass again.
            registry.start()
            wait_for(lambda: "the watch is back" in sync.log_text(), 30, "the watch is back")
            wait_for(lambda: passes(commands["readiness"], alive), 5, "ready again")
            assert all(passes(c, alive) for c in commands.values())
        finally:
            sync.stop()
