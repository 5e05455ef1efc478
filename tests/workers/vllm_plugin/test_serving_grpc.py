"""Where the plugin says a gRPC-served instance serves (vLLM's gRPC entrypoint, which smg's vLLM
mode talks to), without vLLM: its ``grpc://`` URL from the command line, its model, and its
readiness from a real gRPC health service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from workers.tools.procs import free_port
from workers.vllm_plugin.serving import _argv_model, _grpc_model, grpc_served, serving_urls
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.unit
MODULE = "/venv/lib/python3.11/site-packages/vllm/entrypoints/grpc_server.py"
LAUNCHER = "/venv/lib/python3.11/site-packages/vllm/entrypoints/launchers/grpc_server.py"


def settings(**extra: Any) -> PluginSettings:
    return PluginSettings(url="http://127.0.0.1:8500", group="g", **extra)


@pytest.mark.parametrize(
    ("program", "argv", "told"),
    [
        ("vllm", ["serve", "m", "--grpc", "--port", "8100"], "grpc://127.0.0.1:8100"),
        ("vllm", ["serve", "m", "--grpc"], "grpc://127.0.0.1:8000"),
        (MODULE, ["--model", "m", "--host", "10.1.2.3"], "grpc://10.1.2.3:50051"),
        (LAUNCHER, ["--model", "m", "--port=7001"], "grpc://127.0.0.1:7001"),
        ("vllm", ["serve", "m", "--port", "8100"], "http://127.0.0.1:8100"),
    ],
)
def test_a_grpc_served_instance_is_told_as_grpc(program: str, argv: list[str], told: str) -> None:
    assert grpc_served(argv, program) == told.startswith("grpc://")
    assert serving_urls(settings(), argv, program)[0] == told


def test_the_model_is_the_served_name_else_the_model() -> None:
    assert _argv_model(["serve", "/m/tiny", "--grpc"]) == "/m/tiny"
    assert _argv_model(["serve", "/m/tiny", "--served-model-name", "tiny"]) == "tiny"
    assert _argv_model(["--model", "/m/tiny", "--port", "9"]) == "/m/tiny"


@pytest.fixture
def health() -> Iterator[tuple[int, Any]]:
    import grpc  # type: ignore[import-untyped]
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

    port = free_port()
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(0)


def test_published_once_the_grpc_health_service_answers_serving(
    health: tuple[int, Any],
) -> None:
    from grpc_health.v1 import health_pb2

    port, servicer = health
    argv = ["serve", "/m/tiny", "--grpc", "--port", str(port)]
    # NOT_SERVING until the deadline: nothing to publish.
    assert _grpc_model(argv, f"grpc://127.0.0.1:{port}", time.monotonic() + 1.5) is None
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    t0 = time.monotonic()
    assert _grpc_model(argv, f"grpc://127.0.0.1:{port}", time.monotonic() + 10) == "/m/tiny"
    assert time.monotonic() - t0 < 5


def test_the_registry_stores_a_grpc_url_as_published_and_refuses_other_schemes() -> None:
    from app.core.addresses import serving_url

    assert serving_url("grpc://10.0.0.12:50051") == "grpc://10.0.0.12:50051"
    assert serving_url("GRPC://[::1]:50051/") == "grpc://[::1]:50051"
    with pytest.raises(ValueError, match=r"is not http\(s\)\|grpc://host:port"):
        serving_url("ftp://10.0.0.12:21")
