"""deploy/k8s rendered as kubectl does, and its pods made up as LWS and the kubelet would.

`render` copies deploy/k8s to a temporary directory, writes the operator's two token files
there (as docs/deployment-kubernetes.md has them do) and runs `kubectl kustomize`. `lws_pod`
fills in what LeaderWorkerSet v0.10.0 and the kubelet give a container of one of its pods:
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX first in its env (LWS's
`addEnvVarsIfNotExists`), the downward API (`metadata.uid`, `metadata.name`, `status.podIP`,
the LWS labels), `secretKeyRef`s read from the rendered Secrets, and `$(VAR)` expanded in env
values, command and args as the kubelet does. Missing tools fail the test instead of skipping
it when CI asks for every tier (`require_tools`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sqlite", "etcd", "tls")
KUBERNETES_VERSION = "1.33"  # the minor the OpenAPI validation targets
LWS_CRD = K8S / "vendor" / "lws-v0.10.0" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS_PREFIX = "leaderworkerset.sigs.k8s.io"
KUBECTL = shutil.which("kubectl")


def strict_ci() -> bool:
    """CI (or ENGINE_REGISTRY_REQUIRE_ALL=1) wants every tier to run: no skipping for tools."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or (
        os.environ.get("ENGINE_REGISTRY_REQUIRE_ALL") == "1"
    )


def require_tools(missing: Sequence[str]) -> None:
    """Skip on a developer machine without the tools; fail under CI, naming the fix."""
    if not missing:
        return
    message = "; ".join(missing)
    if strict_ci():
        pytest.fail(f"CI needs every tier: {message}", pytrace=False)
    pytest.skip(message)


MIN_KUBECTL_MINOR = 27  # kustomize v5 (the `labels` field) is built in from kubectl 1.27


def kubectl_missing() -> list[str]:
    """Why deploy/k8s cannot be rendered here (empty when it can)."""
    if KUBECTL is None:
        return [
            f"needs kubectl 1.{MIN_KUBECTL_MINOR}+ (built-in kustomize) on PATH to render "
            "deploy/k8s; Debian's kubernetes-client (1.20) is too old"
        ]
    run = subprocess.run(
        [KUBECTL, "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    try:
        minor = int(re.sub(r"\D.*", "", json.loads(run.stdout)["clientVersion"]["minor"]))
    except (ValueError, KeyError) as exc:
        return [f"cannot read `kubectl version --client` ({exc}): {run.stderr.strip()}"]
    if minor < MIN_KUBECTL_MINOR:
        return [
            f"kubectl 1.{minor} is too old: deploy/k8s needs 1.{MIN_KUBECTL_MINOR}+ (kustomize v5)"
        ]
    return []


def write_tokens(directory: Path, tokens: Mapping[str, str]) -> None:
    """What the operator writes: role:token lines, and the worker token alone."""
    secrets = directory / "base" / "secrets"
    (secrets / "tokens").write_text("".join(f"{role}:{tok}\n" for role, tok in tokens.items()))
    (secrets / "worker-token.env").write_text(f"token={tokens['worker']}\n")
    (secrets / "reader-token.env").write_text(f"token={tokens['reader']}\n")


def write_tls(directory: Path) -> None:
    """What the operator copies into overlays/tls/secrets: a certificate for the registry's
    Service names, its key, and the CA that signed it (made now, with trustme)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("engine-registry", "engine-registry.engine-registry.svc")
    secrets = directory / "overlays" / "tls" / "secrets"
    secrets.mkdir(parents=True, exist_ok=True)
    cert.cert_chain_pems[0].write_to_path(str(secrets / "tls.crt"))
    cert.private_key_pem.write_to_path(str(secrets / "tls.key"))
    ca.cert_pem.write_to_path(str(secrets / "ca.crt"))


def render(overlay: str, tmp: Path, tokens: Mapping[str, str]) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>` with these tokens, as objects."""
    assert KUBECTL is not None
    tree = tmp / f"k8s-{overlay}"
    if not tree.exists():
        shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("tokens", "*-token.env"))
        write_tokens(tree, tokens)
        write_tls(tree)
    run = subprocess.run(
        [KUBECTL, "kustomize", str(tree / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def find(objects: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the rendered set"
    return found[0]


def secret_named(objects: Sequence[dict[str, Any]], base_name: str) -> dict[str, Any]:
    """A generated Secret by the name it has before kustomize's hash suffix."""
    found = [
        o
        for o in objects
        if o["kind"] == "Secret"
        and re.fullmatch(rf"{base_name}-[a-z0-9]{{10}}", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"Secret {base_name}-<hash>: {len(found)} in the rendered set"
    return found[0]


def secret_value(objects: Sequence[dict[str, Any]], name: str, key: str) -> str:
    """What the kubelet puts in an env var from secretKeyRef {name, key}."""
    matches = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise LookupError(f"secretKeyRef names Secret {name!r}, not in the rendered set")
    data = matches[0].get("data") or {}
    if key not in data:
        raise LookupError(f"secretKeyRef names key {key!r} of Secret {name!r}: no such key")
    return base64.b64decode(data[key]).decode()


# -- the kubelet's $(VAR) expansion ---------------------------------------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """`$(VAR)` becomes VAR's value when defined (else stays as written); `$$` is `$`."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REF.sub(sub, text)


@dataclass(frozen=True)
class PodIdentity:
    """What one pod of an LWS group is: LWS's labels and annotations, the kubelet's facts."""

    lws: str
    group_index: int
    worker_index: int
    size: int
    namespace: str
    uid: str
    ip: str

    @property
    def name(self) -> str:
        base = f"{self.lws}-{self.group_index}"
        return base if self.worker_index == 0 else f"{base}-{self.worker_index}"

    @property
    def leader_address(self) -> str:
        # pod_utils.AddLWSVariables: <lws>-<group>.<subdomain>.<namespace>, the subdomain
        # being the LWS's headless Service, named after the LWS (SubdomainShared).
        return f"{self.lws}-{self.group_index}.{self.lws}.{self.namespace}"

    def field(self, path: str) -> str:
        labels = {
            f"{LWS_PREFIX}/name": self.lws,
            f"{LWS_PREFIX}/group-index": str(self.group_index),
            f"{LWS_PREFIX}/worker-index": str(self.worker_index),
        }
        simple = {
            "metadata.uid": self.uid,
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "status.podIP": self.ip,
        }
        if path in simple:
            return simple[path]
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if label and label[1] in labels:
            return labels[label[1]]
        annotation = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
        if annotation and annotation[1] == f"{LWS_PREFIX}/size":
            return str(self.size)
        raise LookupError(f"downward API field {path!r} is not one LWS or the kubelet provides")


@dataclass(frozen=True)
class Container:
    argv: list[str]
    env: dict[str, str]
    spec: dict[str, Any]

    def probe_argv(self, kind: str) -> list[str]:
        """An exec probe's command (the kubelet runs it as written: no $(VAR) expansion)."""
        probe = self.spec.get(kind) or {}
        assert "exec" in probe, f"{kind} of {self.spec['name']} is not an exec probe"
        return [str(a) for a in probe["exec"]["command"]]


def pod_template(lws: Mapping[str, Any], worker_index: int) -> dict[str, Any]:
    """The template LWS uses for this pod: the leader's (index 0) when given, else workers'."""
    template = lws["spec"]["leaderWorkerTemplate"]
    if worker_index == 0 and "leaderTemplate" in template:
        chosen: dict[str, Any] = template["leaderTemplate"]
    else:
        chosen = template["workerTemplate"]
    return chosen


def lws_pod(
    lws: Mapping[str, Any], pod: PodIdentity, objects: Sequence[dict[str, Any]]
) -> Container:
    """The one container of this pod, with the env and argv the kubelet would start."""
    containers = pod_template(lws, pod.worker_index)["spec"]["containers"]
    assert len(containers) == 1, [c["name"] for c in containers]
    spec: dict[str, Any] = containers[0]
    env: dict[str, str] = {
        "LWS_LEADER_ADDRESS": pod.leader_address,
        "LWS_GROUP_SIZE": str(pod.size),
        "LWS_WORKER_INDEX": str(pod.worker_index),
    }
    for item in spec.get("env", []):
        if item["name"] in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
            continue  # LWS keeps its own (addEnvVarsIfNotExists)
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = expand(str(item.get("value", "")), env)
        elif "fieldRef" in source:
            env[item["name"]] = pod.field(source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = secret_value(objects, ref["name"], ref["key"])
        else:
            raise LookupError(f"env {item['name']}: valueFrom {sorted(source)} not supported")
    argv = [expand(str(a), env) for a in [*spec.get("command", []), *spec.get("args", [])]]
    return Container(argv, env, spec)


def plain_container(spec: Mapping[str, Any]) -> Container:
    """A container of a built-in workload (no downward API in its env): the registry's."""
    env = {}
    for item in spec.get("env", []):
        assert "valueFrom" not in item, f"{spec['name']}: env {item['name']} from elsewhere"
        env[item["name"]] = expand(str(item.get("value", "")), env)
    argv = [expand(str(a), env) for a in [*spec.get("command", []), *spec.get("args", [])]]
    return Container(argv, env, dict(spec))
