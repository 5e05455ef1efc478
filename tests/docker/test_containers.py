"""The project's images, built and run for real: docker/Dockerfile and docker/compose.yaml with a
real Docker engine (Debian's docker.io; started here if none runs, and then stopped with its
network changes undone) and Debian's docker-compose.

The images build from this machine's pip configuration (tests/docker/images.py); without a
container registry, their base and etcd's image are made from Debian packages and passed in
as `PYTHON_IMAGE` and `ETCD_IMAGE`. Each image's size is printed. Two compose cycles run the
three set-ups: the default one (SQLite registry, a TP-2 prefill over two containers, a decode
that verifies every byte it pulls over NIXL, prefill nodes stopped), and the `ha` profile under
the TLS overlay (etcd x3, two replicas, mutual TLS: a client without a certificate refused,
`registry` killed, a new decode served by `registry-2`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import free_port
from tests.docker.compose_support import COMPOSE_FILE, DOCKER, HA_ENV_FILE, ROOT
from tests.docker.containers import COMPOSE_BIN, Compose
from tests.docker.images import Images, pip_settings, served_pip_sources
from tests.support import dockerd

MMDEBSTRAP = shutil.which("mmdebstrap")
SKIP_REASON = dockerd.unavailable_reason() or (
    "needs docker-compose and mmdebstrap (make system-deps)"
    if COMPOSE_BIN is None or MMDEBSTRAP is None
    else None
)
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"containers: {SKIP_REASON}"),
    pytest.mark.timeout(2400),  # a cold first run builds torch's image
]

FULL = "engine-registry:tier"
SERVICE = "engine-registry:tier-service"
IMAGE_UID = 10001
ROUND = re.compile(r"round (\d+): (\d+) bytes from engine (\S+) ranks \[([\d, ]+)\].*verified")


@dataclass(frozen=True)
class Built:
    images: Images
    bases: dict[str, str]


@pytest.fixture(scope="module")
def built(docker_engine: dockerd.DockerEngine, tmp_path_factory: pytest.TempPathFactory) -> Built:
    images = Images(docker_engine.docker, tmp_path_factory.mktemp("images"))
    bases = images.bases()
    with served_pip_sources(pip_settings()) as pip_args:
        common = {**pip_args, "PYTHON_IMAGE": bases["PYTHON_IMAGE"]}
        # The service image, with the torch index left at its default (unreachable without
        # a registry's network): it is never asked, so pip neither waits nor retries.
        images.build(SERVICE, {**common, "EXTRAS": "etcd"})
        service_log = images.build_log(SERVICE).read_text()
        assert "download.pytorch.org" not in service_log, service_log[-3000:]
        # The full image: torch from wherever this machine's pip finds it.
        images.build(FULL, {**common, "TORCH_INDEX_URL": ""})
    for image in (*bases.values(), SERVICE, FULL):
        print(f"image {image}: {images.size(image) / 1e6:.0f} MB")
    for step, took in images.timings.items():
        print(f"{step}: {took:.1f}s")
    return Built(images, bases)


def docker_run(built: Built, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [built.images.docker, "run", "--rm", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_images_hold_the_pinned_torch_build_or_none(built: Built) -> None:
    service = docker_run(
        built,
        SERVICE,
        "sh",
        "-c",
        "engine-registry serve --help >/dev/null && python -c 'import torch'",
    )
    assert "No module named 'torch'" in service.stderr, service  # and the service starts
    # The build's own check, run against the built torch: another build than asked fails.
    check = [
        "-v",
        f"{ROOT / 'pyproject.toml'}:/src/pyproject.toml:ro",
        "-v",
        f"{DOCKER / 'install.sh'}:/install.sh:ro",
        "-e",
        "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128",
    ]
    refused = docker_run(
        built, *check, "-e", "TORCH_BUILD=cu128", FULL, "sh", "/install.sh", "check-torch"
    )
    assert refused.returncode != 0, refused
    assert "torch 2.13.0+cpu got installed, but the image pins torch 2.13.0+cu128" in refused.stderr
    full = docker_run(
        built,
        *check,
        "-e",
        "TORCH_BUILD=cpu",
        FULL,
        "sh",
        "-c",
        "sh /install.sh check-torch && python -c 'import nixl, torch; print(torch.__version__)'",
    )
    assert full.returncode == 0, full.stderr
    assert full.stdout.split() == ["torch", "2.13.0+cpu:", "the", "pinned", "build", "2.13.0+cpu"]


def write_tokens(directory: Path) -> tuple[dict[str, str], Path]:
    tokens = {role: secrets.token_urlsafe(24) for role in ("worker", "reader", "admin")}
    path = directory / "tokens"
    path.write_text("".join(f"{role}:{tok}\n" for role, tok in tokens.items()))
    secret_file(path)
    return tokens, path


def secret_file(path: Path) -> None:
    """Readable by the image's user only, as docs/deployment.md has the operator do."""
    os.chown(path, IMAGE_UID, -1)
    path.chmod(0o600)


@pytest.fixture
def compose_project() -> Iterator[list[Compose]]:
    """The compose projects a test starts, taken down (volumes too) whatever happens."""
    projects: list[Compose] = []
    yield projects
    for project in projects:
        project.down()


def decode_rounds(log: str) -> list[tuple[int, int, str, list[int]]]:
    return [
        (int(m[1]), int(m[2]), m[3], [int(r) for r in m[4].split(",")]) for m in ROUND.finditer(log)
    ]


def assert_stopped_cleanly(compose: Compose, service: str) -> None:
    """`docker compose stop`: exit 0, one line saying so, no traceback."""
    log = compose.logs(service)
    assert compose.exit_code(service) == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert len(re.findall(r"stopped by SIGTERM", log)) == 1, log[-3000:]


def test_default_setup_verifies_every_byte_and_stops_cleanly(
    built: Built, tmp_path: Path, compose_project: list[Compose]
) -> None:
    tokens, token_file = write_tokens(tmp_path)
    port = free_port()
    compose = Compose(
        built.images.docker,
        [COMPOSE_FILE],
        {
            "ENGINE_REGISTRY_IMAGE": FULL,
            **built.bases,
            "WORKER_TOKEN": tokens["worker"],
            "REGISTRY_TOKENS_SECRET": str(token_file),
            "REGISTRY_PUBLISH": f"127.0.0.1:{port}",
        },
        "ertierdefault",
    )
    compose_project.append(compose)
    compose.down()  # a stale run's
    started = time.monotonic()
    compose("up", "-d", "--no-build", timeout=400)  # waits for registry and prefill health
    up_s = time.monotonic() - started
    compose.wait_for("decode", "exited", 240)
    decode_log = compose.logs("decode")
    assert compose.exit_code("decode") == 0, decode_log[-4000:]
    rounds = decode_rounds(decode_log)
    assert [r[0] for r in rounds] == [1, 2, 3], decode_log[-4000:]
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {tokens['reader']}"}
    engine = httpx.get(f"{url}/tp-groups/prefill-0/engine", headers=auth, timeout=10).json()
    assert engine["tp_size"] == 2
    assert engine["ready"]
    assert engine["registered_ranks"] == [0, 1]
    assert len({a["host"] for a in engine["agents"]}) == 2  # one rank in each container
    for _, size, engine_id, targets in rounds:
        assert engine_id == engine["engine_id"]
        assert targets == [0, 1]  # decode TP 1 reads both prefill containers
        assert size > 0

    compose("stop", "-t", "30", "prefill-node0", "prefill-node1")
    for node in ("prefill-node0", "prefill-node1"):
        assert_stopped_cleanly(compose, node)
    after = httpx.get(f"{url}/tp-groups/prefill-0/engine", headers=auth, timeout=10).json()
    assert after["registered_ranks"] == [], after  # deregistered on stop, not expired
    compose("stop", "-t", "30", "registry")  # drains, closes the store, exits 0
    assert compose.exit_code("registry") == 0, compose.logs("registry")[-3000:]
    print(
        f"default set-up: up (registry and prefill healthy) in {up_s:.1f}s; decode verified "
        f"{sum(r[1] for r in rounds)} bytes in {len(rounds)} rounds; whole cycle "
        f"{time.monotonic() - started:.1f}s\n  " + "\n  ".join(compose.log)
    )


def make_tls_files(directory: Path) -> dict[str, Path]:
    import trustme

    ca = trustme.CA(organization_name="compose test CA")
    server = ca.issue_cert("registry", "registry-2", "localhost", "127.0.0.1")
    client = ca.issue_cert("worker.client.test", common_name="worker")
    files = {
        "REGISTRY_CA_SECRET": directory / "ca.pem",
        "REGISTRY_TLS_CERT_SECRET": directory / "registry.crt",
        "REGISTRY_TLS_KEY_SECRET": directory / "registry.key",
        "REGISTRY_CLIENT_CERT_SECRET": directory / "client.crt",
        "REGISTRY_CLIENT_KEY_SECRET": directory / "client.key",
    }
    ca.cert_pem.write_to_path(str(files["REGISTRY_CA_SECRET"]))
    for issued, cert, key in (
        (server, "REGISTRY_TLS_CERT_SECRET", "REGISTRY_TLS_KEY_SECRET"),
        (client, "REGISTRY_CLIENT_CERT_SECRET", "REGISTRY_CLIENT_KEY_SECRET"),
    ):
        for n, pem in enumerate(issued.cert_chain_pems):
            pem.write_to_path(str(files[cert]), append=n > 0)
        issued.private_key_pem.write_to_path(str(files[key]))
    for path in files.values():
        secret_file(path)
    return files


def https_get(port: int, path: str, files: Mapping[str, Path], token: str) -> Any:
    context = ssl.create_default_context(cafile=str(files["REGISTRY_CA_SECRET"]))
    context.load_cert_chain(
        str(files["REGISTRY_CLIENT_CERT_SECRET"]), str(files["REGISTRY_CLIENT_KEY_SECRET"])
    )
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(verify=context, timeout=10) as client:
        answer = client.get(f"https://127.0.0.1:{port}{path}", headers=headers)
    answer.raise_for_status()
    return answer.json()


def refusal_without_certificate(port: int, ca: Path) -> str:
    """What a client trusting the CA but presenting no certificate gets from the registry."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="registry") as tls,
        ):
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: registry\r\n\r\n")
            answer = tls.recv(4096)
    except (ssl.SSLError, ConnectionResetError) as exc:
        return str(exc)
    return f"answered: {answer[:200]!r}"


def test_ha_profile_over_mutual_tls_survives_a_killed_replica_and_refuses_a_bare_client(
    built: Built, tmp_path: Path, compose_project: list[Compose]
) -> None:
    tokens, token_file = write_tokens(tmp_path)
    files = make_tls_files(tmp_path)
    ports = {"registry": free_port(), "registry-2": free_port()}
    compose = Compose(
        built.images.docker,
        [COMPOSE_FILE, DOCKER / "compose.tls.yaml"],
        {
            "ENGINE_REGISTRY_IMAGE": FULL,
            **built.bases,
            "WORKER_TOKEN": tokens["worker"],
            "REGISTRY_TOKENS_SECRET": str(token_file),
            **{name: str(path) for name, path in files.items()},
            "REGISTRY_PUBLISH": f"127.0.0.1:{ports['registry']}",
            "REGISTRY_2_PUBLISH": f"127.0.0.1:{ports['registry-2']}",
            # ha.env names both replicas over http://; under the TLS overlay they are https://.
            "WORKERS_REGISTRY_URL": "https://registry:8080,https://registry-2:8080",
        },
        "ertierha",
        env_file=HA_ENV_FILE,
    )
    compose_project.append(compose)
    compose.down()
    started = time.monotonic()
    # Everything but the decode: etcd x3, both replicas, the prefill group (healthy = ready).
    compose("up", "-d", "--no-build", "prefill-node1", "registry-2", timeout=400)
    compose.wait_for("prefill-node0", "healthy", 180)
    up_s = time.monotonic() - started
    seen = [
        https_get(ports[name], "/tp-groups/prefill-0/engine", files, tokens["reader"])
        for name in ("registry", "registry-2")
    ]
    assert seen[0]["engine_id"] == seen[1]["engine_id"]  # one store: the etcd cluster
    assert seen[1]["ready"], seen[1]
    engine_id = seen[0]["engine_id"]

    refusal = refusal_without_certificate(ports["registry-2"], files["REGISTRY_CA_SECRET"])
    assert "certificate" in refusal.lower(), refusal  # TLS alert: certificate required

    compose("kill", "registry")  # SIGKILL; the workers carry on through registry-2
    compose("up", "-d", "--no-build", "--no-deps", "decode")
    compose.wait_for("decode", "exited", 240)
    decode_log = compose.logs("decode")
    assert compose.exit_code("decode") == 0, decode_log[-4000:]
    rounds = decode_rounds(decode_log)
    assert [r[0] for r in rounds] == [1, 2, 3], decode_log[-4000:]
    assert {r[2] for r in rounds} == {engine_id}
    assert compose.state("registry")["Status"] == "exited"

    compose("stop", "-t", "30", "prefill-node0", "prefill-node1")
    for node in ("prefill-node0", "prefill-node1"):
        assert_stopped_cleanly(compose, node)
    after = https_get(ports["registry-2"], "/tp-groups/prefill-0/engine", files, tokens["reader"])
    assert after["engine_id"] == engine_id
    assert after["registered_ranks"] == [], after  # deregistered through registry-2
    print(
        f"ha + TLS set-up: up in {up_s:.1f}s; a client without a certificate: {refusal}; "
        f"decode verified {sum(r[1] for r in rounds)} bytes through registry-2; whole cycle "
        f"{time.monotonic() - started:.1f}s\n  " + "\n  ".join(compose.log)
    )
