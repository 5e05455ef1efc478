"""deploy/k8s rendered by `kubectl kustomize` and checked as a cluster and a reviewer would.

Every rendered object against the Kubernetes 1.33 OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail); each LeaderWorkerSet against the vendored LWS v0.10.0 CRD's own schema,
made strict the same way, and its pod templates against Kubernetes' PodTemplate; then the
policies: probes, pinned images, resources, security contexts, every variable the vLLM plugin
needs, Secret references that resolve, TP sizes that match the GPUs, and the registry's store
per overlay. The first tests show that each validator fails on a broken object.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy import k8s_support as k8s
from workers.vllm_plugin import ENV_URL
from workers.vllm_plugin.hook import ENV_GROUP, ENV_LAUNCH, ENV_ROLE, ENV_TOKEN

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(120)]

TOKENS = {role: f"{role}-token-for-manifest-tests-0123" for role in ("reader", "worker", "admin")}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    k8s.require_tools(k8s.kubectl_missing())
    tmp = tmp_path_factory.mktemp("render")
    return {overlay: k8s.render(overlay, tmp, TOKENS) for overlay in k8s.OVERLAYS}


def _strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def lws_schema() -> dict[str, Any]:
    crd = yaml.safe_load(k8s.LWS_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = _strict(version["schema"]["openAPIV3Schema"])
    return schema


def validate_lws(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(schema).validate(obj)
    template = obj["spec"]["leaderWorkerTemplate"]
    for which in ("leaderTemplate", "workerTemplate"):
        if which in template:
            kubernetes_validate.validate(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{obj['metadata']['name']}-{which}"},
                    "template": template[which],
                },
                k8s.KUBERNETES_VERSION,
                strict=True,
            )


def validate(obj: dict[str, Any], lws_schema: dict[str, Any]) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        validate_lws(obj, lws_schema)
    else:
        kubernetes_validate.validate(obj, k8s.KUBERNETES_VERSION, strict=True)


def containers(
    objects: list[dict[str, Any]],
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod spec, container) for every container of every workload."""
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        specs: list[tuple[str, dict[str, Any]]] = []
        if obj["kind"] in ("StatefulSet", "Deployment"):
            specs.append((where, obj["spec"]["template"]["spec"]))
        elif obj["kind"] == "LeaderWorkerSet":
            template = obj["spec"]["leaderWorkerTemplate"]
            specs += [
                (f"{where} {t}", template[t]["spec"])
                for t in ("leaderTemplate", "workerTemplate")
                if t in template
            ]
        for label, pod in specs:
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                yield f"{label} {container['name']}", pod, container


def lws_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(lws name, container, leader|worker) of every LWS pod template."""
    for obj in objects:
        if obj["kind"] != "LeaderWorkerSet":
            continue
        template = obj["spec"]["leaderWorkerTemplate"]
        # Without a leaderTemplate the workerTemplate makes the leader too; size 1: only it.
        worker_role = "worker" if "leaderTemplate" in template or template["size"] > 1 else "leader"
        for which, role in (("leaderTemplate", "leader"), ("workerTemplate", worker_role)):
            if which in template:
                (container,) = template[which]["spec"]["containers"]
                yield obj["metadata"]["name"], container, role


# -- the validators can fail ------------------------------------------------------------------


def test_validators_reject_unknown_fields_and_bad_values(
    rendered: dict[str, list[dict[str, Any]]], lws_schema: dict[str, Any]
) -> None:
    objects = rendered["sqlite"]
    sts = copy.deepcopy(k8s.find(objects, "StatefulSet", "engine-registry"))
    sts["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        validate(sts, lws_schema)
    prefill = k8s.find(objects, "LeaderWorkerSet", "prefill")
    typo = copy.deepcopy(prefill)
    typo["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    with pytest.raises(jsonschema.ValidationError, match="sizes"):
        validate(typo, lws_schema)
    policy = copy.deepcopy(prefill)
    policy["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupSometimes"
    with pytest.raises(jsonschema.ValidationError, match="RecreateGroupSometimes"):
        validate(policy, lws_schema)
    pod = copy.deepcopy(prefill)
    pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["ports"][0][
        "containerPort"
    ] = "5600"  # a string where Kubernetes wants an integer
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(pod, lws_schema)


# -- schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_rendered_object_validates_against_its_schema(
    rendered: dict[str, list[dict[str, Any]]], lws_schema: dict[str, Any], overlay: str
) -> None:
    kinds = set()
    for obj in rendered[overlay]:
        validate(obj, lws_schema)
        kinds.add(obj["kind"])
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") == "engine-registry"
    assert {"Service", "Secret", "LeaderWorkerSet", "Namespace"} <= kinds


# -- policy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_container_is_pinned_bounded_locked_down_and_probed(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    seen = 0
    for where, pod, c in containers(rendered[overlay]):
        seen += 1
        image = c["image"]
        assert re.search(r"(:[\w.-]+|@sha256:[0-9a-f]{64})$", image), f"{where}: untagged {image}"
        assert not image.endswith(":latest"), f"{where}: {image}"
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{where}: requests {requests}"
        assert "memory" in c["resources"].get("limits", {}), f"{where}: no memory limit"
        sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, where
        assert sc.get("privileged") is not True, where
        assert "ALL" in sc.get("capabilities", {}).get("drop", []), where
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert pod.get("automountServiceAccountToken") is False, where
        assert "readinessProbe" in c, f"{where}: no readiness probe"
        assert "startupProbe" in c or "livenessProbe" in c, f"{where}: no start/liveness probe"
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if "engine-registry" in image:  # our images write only where a volume is
            assert "/tmp" in mounts, f"{where}: read-only root and no /tmp volume"
    assert seen >= 4


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_secret_references_resolve_and_tokens_agree(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    refs = 0
    for where, pod, c in containers(objects):
        for item in c.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref.get("optional"):
                continue  # a Secret the operator may add (smg's admin key): absent is fine
            if ref:
                refs += 1
                value = k8s.secret_value(objects, ref["name"], ref["key"])
                assert value, f"{where}: {item['name']} from an empty Secret key"
                # A newline in a token variable makes an illegal Authorization header.
                assert value == value.strip(), f"{where}: {item['name']} has surrounding space"
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                refs += 1
                name = volume["secret"]["secretName"]
                names = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
                assert name in names, f"{where}: Secret {name} not rendered"
    assert refs >= 4
    tokens = k8s.secret_value(
        objects, k8s.secret_named(objects, "engine-registry-tokens")["metadata"]["name"], "tokens"
    )
    worker = k8s.secret_value(
        objects,
        k8s.secret_named(objects, "engine-registry-worker-token")["metadata"]["name"],
        "token",
    ).strip()
    assert f"worker:{worker}" in tokens.splitlines(), "the workers' token is not a worker token"


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_registry_is_probed_exposed_and_reads_tokens_from_the_secret(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    kind = "Deployment" if overlay == "etcd" else "StatefulSet"
    workload = k8s.find(objects, kind, "engine-registry")
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(env["REGISTRY_PORT"]) == ports["http"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert Path(env["REGISTRY_TOKENS_FILE"]).parent == Path(mounts["tokens"])
    service = k8s.find(objects, "Service", "engine-registry")
    assert (
        service["spec"]["selector"].items()
        <= workload["spec"]["template"]["metadata"]["labels"].items()
    )
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["metrics"]["targetPort"] == "http"  # ServiceMonitor: port metrics
    if overlay != "etcd":
        assert workload["spec"]["replicas"] == 1  # SQLite: one writer
        db = env["REGISTRY_STORE"].removeprefix("sqlite:///")
        claims = {t["metadata"]["name"] for t in workload["spec"]["volumeClaimTemplates"]}
        assert "data" in claims
        assert Path(db).parent == Path(mounts["data"])
    else:
        assert workload["spec"]["replicas"] >= 2
        etcd = k8s.find(objects, "StatefulSet", "etcd")
        members = [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
        assert len(members) == 3
        peers = k8s.find(objects, "Service", "etcd")
        assert peers["spec"]["clusterIP"] == "None"
        assert etcd["spec"]["serviceName"] == "etcd"
        store = env["REGISTRY_STORE"]
        assert store == "etcd://" + ",".join(f"{m}.etcd:2379" for m in members) + "/engine-registry"
        argv = " ".join(etcd["spec"]["template"]["spec"]["containers"][0]["command"])
        cluster = ",".join(f"{m}=http://{m}.etcd:2380" for m in members)
        assert f"--initial-cluster={cluster}" in argv
        assert not [
            o
            for o in objects
            if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "engine-registry"
        ]


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_vllm_pods_carry_the_plugin_and_a_coherent_lws_topology(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    service = k8s.find(objects, "Service", "engine-registry")
    http_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    roles = {}
    for obj in objects:
        if obj["kind"] == "LeaderWorkerSet":
            template = obj["spec"]["leaderWorkerTemplate"]
            assert template["restartPolicy"] == "RecreateGroupOnPodRestart", obj["metadata"]
    for lws, c, role in lws_templates(objects):
        where = f"LeaderWorkerSet/{lws} {role}"
        obj = k8s.find(objects, "LeaderWorkerSet", lws)
        size = obj["spec"]["leaderWorkerTemplate"]["size"]
        env = {e["name"]: e for e in c["env"]}
        value = {n: e.get("value") for n, e in env.items()}
        field = {
            n: e["valueFrom"]["fieldRef"]["fieldPath"]
            for n, e in env.items()
            if "fieldRef" in e.get("valueFrom", {})
        }
        for name in (ENV_URL, ENV_GROUP, ENV_TOKEN, ENV_ROLE):
            assert name in env, f"{where}: the plugin needs {name}"
        scheme = "https" if overlay == "tls" else "http"
        assert value[ENV_URL] == f"{scheme}://engine-registry:{http_port}", where
        assert "secretKeyRef" in env[ENV_TOKEN]["valueFrom"], f"{where}: token not from a Secret"
        # group id: the LWS name and group index, from the pod's LWS labels
        assert value[ENV_GROUP] == "$(LWS_NAME)-$(LWS_GROUP_INDEX)", where
        assert field["LWS_NAME"] == f"metadata.labels['{k8s.LWS_PREFIX}/name']"
        assert field["LWS_GROUP_INDEX"] == f"metadata.labels['{k8s.LWS_PREFIX}/group-index']"
        roles[lws] = value[ENV_ROLE]
        # the side channel where the pod is reachable, on a named port
        assert value["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)", where
        assert field["POD_IP"] == "status.podIP", where
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["nixl-side"] == int(value["VLLM_NIXL_SIDE_CHANNEL_PORT"]), where
        # the launch id: the leader pod's UID (TP rank 0 lives there and opens the engine)
        if role == "leader":
            assert value[ENV_LAUNCH] == "$(POD_UID)", where
            assert field["POD_UID"] == "metadata.uid", where
        else:
            assert ENV_LAUNCH not in env, f"{where}: only the leader's launch id counts"
        # the readiness gate: the registry's view of the engine, with a model-loading budget
        for kind in ("readinessProbe", "startupProbe"):
            assert c[kind]["exec"]["command"][:2] == ["engine-registry", "probe"], where
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60, where
        probe_argv = " ".join(c["readinessProbe"]["exec"]["command"])
        deadline = re.search(r"--timeout=(\S+)", probe_argv)
        assert deadline is not None, f"{where}: the probe needs its own --timeout"
        timeout = float(deadline[1])
        assert timeout < c["readinessProbe"]["timeoutSeconds"], f"{where}: probe outlives kubelet"
        # Ray-free multi-node vLLM: flags from LWS, --headless exactly on the workers
        argv = [*c["command"], *c["args"]]
        assert argv[:2] == ["vllm", "serve"], where
        assert ("--headless" in argv) == (role == "worker"), where
        tp = int(next(a.split("=")[1] for a in argv if a.startswith("--tensor-parallel-size=")))
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert tp == gpus * size, f"{where}: TP {tp} != {gpus} GPU(s) x {size} pods"
        if size > 1:
            for flag, var in (
                ("--nnodes", "LWS_GROUP_SIZE"),
                ("--node-rank", "LWS_WORKER_INDEX"),
                ("--master-addr", "LWS_LEADER_ADDRESS"),
            ):
                assert f"{flag}=$({var})" in argv, f"{where}: {flag} must come from {var}"
    assert roles == {"prefill": "prefill", "decode": "decode"}
    prefill = k8s.find(objects, "LeaderWorkerSet", "prefill")["spec"]["leaderWorkerTemplate"]
    assert prefill["size"] == 2


def test_the_vendored_lws_crd_is_the_release_it_names() -> None:
    import hashlib

    source = (k8s.LWS_CRD.parent / "SOURCE").read_text()
    assert "release:  v0.10.0" in source
    assert "kubernetes-sigs/lws" in source
    digest = hashlib.sha256(k8s.LWS_CRD.read_bytes()).hexdigest()
    assert f"sha256:   {digest}" in source, "the CRD file changed: vendor it again, update SOURCE"


def test_missing_tools_fail_under_ci_and_skip_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI needs every tier: needs kubectl"):
        k8s.require_tools(["needs kubectl"])
    monkeypatch.delenv("CI")
    monkeypatch.delenv("ENGINE_REGISTRY_REQUIRE_ALL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs kubectl"):
        k8s.require_tools(["needs kubectl"])
    k8s.require_tools([])  # nothing missing: runs


def test_the_vllm_image_runs_a_vllm_the_plugin_supports_as_non_root() -> None:
    from tests.docker.compose_support import DOCKER, dockerfile_instructions
    from workers.vllm_plugin import SUPPORTED_VLLM_VERSIONS

    # The compose image's Dockerfile has no vLLM stage: the classic builder builds every
    # stage up to the target, so one there would be built by every default build.
    default = dockerfile_instructions()
    assert not [i for i in default if i.keyword == "FROM" and "vllm" in i.args], default
    instructions = dockerfile_instructions(DOCKER / "vllm.Dockerfile")
    stages = {i.stage: i.args.split()[-1] for i in instructions if i.keyword == "FROM"}
    assert stages[max(stages)] == "vllm", "the last stage, the default target, is the image"
    (vllm,) = [n for n, name in stages.items() if name == "vllm"]
    (build,) = [n for n, name in stages.items() if name == "vllm-build"]
    args = dict(
        i.args.split("=", 1) for i in instructions if i.stage == build and i.keyword == "ARG"
    )
    assert args["VLLM_VERSION"] in SUPPORTED_VLLM_VERSIONS, args
    users = [i.args for i in instructions if i.stage == vllm and i.keyword == "USER"]
    assert users, "the vllm target must not run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_the_tls_overlay_serves_https_from_secrets_and_gives_the_clients_only_the_ca(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """overlays/tls: the registry's certificate and key come from a Secret and load into the
    service's own TLS context; its probes use HTTPS; every vLLM container trusts the CA from a
    Secret that holds no key, through ENGINE_REGISTRY_CA."""
    from app.security.tls import server_context
    from app.server.settings import Settings
    from registry_client.tls import ClientTLS

    objects = rendered["tls"]
    workload = k8s.find(objects, "StatefulSet", "engine-registry")
    pod = workload["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for name in ("REGISTRY_TLS_CERT", "REGISTRY_TLS_KEY"):
        path = Path(env[name])
        secret = volumes[mounts[str(path.parent)]]["secret"]["secretName"]
        files[name] = tmp_path / path.name
        files[name].write_text(k8s.secret_value(objects, secret, path.name))
    settings = Settings(
        host=env["REGISTRY_HOST"],
        tokens="worker:" + "w" * 24,
        tls_cert=files["REGISTRY_TLS_CERT"],
        tls_key=files["REGISTRY_TLS_KEY"],
    )
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    server_context(settings.tls_cert, settings.tls_key)  # a chain and its key
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
    checked = 0
    for lws, vllm, role in lws_templates(objects):
        vllm_env = {e["name"]: e.get("value") for e in vllm["env"]}
        ca = Path(vllm_env["ENGINE_REGISTRY_CA"])
        template = k8s.find(objects, "LeaderWorkerSet", lws)["spec"]["leaderWorkerTemplate"]
        which = "leaderTemplate" if role == "leader" and "leaderTemplate" in template else ""
        spec = template[which or "workerTemplate"]["spec"]
        vllm_mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
        volume = {v["name"]: v for v in spec["volumes"]}[vllm_mounts[str(ca.parent)]]
        secret = volume["secret"]["secretName"]
        keys = next(o for o in objects if o["metadata"]["name"] == secret)["data"].keys()
        assert set(keys) == {ca.name}, f"LeaderWorkerSet/{lws} {role}: {secret} has {keys}"
        (tmp_path / ca.name).write_text(k8s.secret_value(objects, secret, ca.name))
        ClientTLS(ca=tmp_path / ca.name)
        checked += 1
    assert checked == 3  # prefill leader and worker, decode
