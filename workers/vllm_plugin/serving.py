"""The instance says where it serves, for routers: its API server publishes its URL.

In the launch's first process (the API server; never on a headless node), a thread waits
until the OpenAI API answers ``/health`` on this host, reads the served model from
``/v1/models``, and publishes (``PUT /tp-groups/{group}/engine/serving``) the URL a router
reaches, the model, the data-parallel rank and the NIXL side channel, for the engine of this
launch only (its ``launch_id``). The URL is ``ENGINE_REGISTRY_ADVERTISE_URL`` when set (NAT, a
Kubernetes Service), else ``http://{--host}:{--port}`` of the vLLM command line (port 8000
by default) with a wildcard or absent host replaced by the address that routes to the
registry. It is withdrawn when the process exits, and goes with the engine when the group is
relaunched; a router stops using the instance once its ranks' leases lapse (not ready).

An instance served by vLLM's gRPC entrypoint (``vllm serve … --grpc``, or ``python -m
vllm.entrypoints.grpc_server`` whose port defaults to 50051; the gateway smg's vLLM mode)
publishes ``grpc://{host}:{port}`` instead, once the standard gRPC health service answers
SERVING, with the model its command line names (``--served-model-name``, else the model).
vLLM loads general plugins there too (``AsyncEngineArgs.add_cli_args`` and the engine
arguments both call ``load_general_plugins``), so the plugin needs no other hook. That server
has no HTTP ``/metrics``: with ``ENGINE_REGISTRY_GRPC_METRICS_PORT`` set, the plugin serves
prometheus_client's registry (vLLM's series, NIXL's among them, and the plugin's) on that port.
"""

from __future__ import annotations

import atexit
import ipaddress
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from registry_client.errors import NotFound, RegistryError
from workers.vllm_plugin import common
from workers.vllm_plugin.common import log
from workers.vllm_plugin.settings import PluginSettings

WAIT_S = 3600.0  # a vLLM start (model load, compile) may take this long; then it gives up
MAX_DP = 64


def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


GRPC_MODULES = ("grpc_server.py",)  # vllm/entrypoints{,/launchers}/grpc_server.py as argv[0]


def grpc_served(argv: Sequence[str], program: str = "") -> bool:
    """vLLM serves gRPC here: ``vllm serve --grpc``, or its gRPC server module run as main."""
    return "--grpc" in argv or program.replace("\\", "/").endswith(GRPC_MODULES)


def serving_urls(
    settings: PluginSettings, argv: Sequence[str], program: str = ""
) -> tuple[str, str]:
    """(the URL routers are told, the URL this process polls its own API at); gRPC-served
    (`grpc_served`): ``grpc://`` URLs, the module's port defaulting to 50051."""
    grpc = grpc_served(argv, program)
    scheme = "grpc" if grpc else "http"
    host = _flag(argv, "--host") or ""
    default = 50051 if grpc and "--grpc" not in argv else 8000
    port = int(_flag(argv, "--port") or default)
    wildcard = _wildcard(host)
    local = f"{scheme}://{'127.0.0.1' if wildcard else host}:{port}"
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/"), local
    if wildcard:
        from workers.endpoint import advertise_host

        host = advertise_host(settings.urls.split(",")[0])
    return f"{scheme}://{host}:{port}", local


def _argv_model(argv: Sequence[str]) -> str | None:
    """The model a gRPC-served vLLM names: ``--served-model-name``, else ``serve MODEL``,
    else ``--model``."""
    named = _flag(argv, "--served-model-name")
    if named:
        return named
    if "serve" in argv:
        i = list(argv).index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return _flag(argv, "--model")


def _grpc_model(argv: Sequence[str], local: str, stop_at: float) -> str | None:
    """Once ``local``'s gRPC health service answers SERVING: the model its argv names."""
    import grpc  # type: ignore[import-untyped]
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

    with grpc.insecure_channel(local.removeprefix("grpc://")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < stop_at:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return _argv_model(argv)
            except grpc.RpcError:
                pass
            time.sleep(1.0)
    return None


def _wildcard(host: str) -> bool:
    """No host, or one that binds every address (0.0.0.0, ::): not one to advertise."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a DNS name


def _served_model(http: httpx.Client, local: str, stop_at: float) -> str | None:
    """Once ``local`` answers /health: the first model /v1/models lists."""
    while time.monotonic() < stop_at:
        try:
            if http.get(f"{local}/health").status_code == 200:
                models = http.get(f"{local}/v1/models").json().get("data") or []
                return str(models[0]["id"]) if models else None
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    return None


def _groups(
    client: Any, settings: PluginSettings, dp_size: int = MAX_DP
) -> list[tuple[str, int | None, Any]]:
    """(group, DP rank, engine) of this launch: the group, or its "-dp{r}" groups."""
    try:
        return [(settings.group, None, client.get_engine(settings.group))]
    except NotFound:
        pass
    found: list[tuple[str, int | None, Any]] = []
    for rank in range(min(dp_size, MAX_DP)):
        try:
            found.append(
                (
                    f"{settings.group}-dp{rank}",
                    rank,
                    client.get_engine(f"{settings.group}-dp{rank}"),
                )
            )
        except NotFound:
            break
    return found


def publish_when_serving(settings: PluginSettings, argv: Sequence[str]) -> None:
    """The thread's body: wait for the API, then publish; every failure is logged, none
    stops vLLM (an instance that did not publish is simply not offered to routers)."""
    from workers.vllm_plugin.worker_side import side_channel

    program = argv[0] if argv else ""
    url, local = serving_urls(settings, argv[1:], program)
    if grpc_served(argv[1:], program):
        model = _grpc_model(argv[1:], local, time.monotonic() + WAIT_S)
    else:
        with httpx.Client(timeout=5.0) as http:
            model = _served_model(http, local, time.monotonic() + WAIT_S)
    if model is None:
        log.warning("engine-registry: %s never served a model: not published for routers", local)
        return
    host, port = side_channel()
    published: list[tuple[str, str]] = []
    try:
        with common.client(settings) as client:
            dp_size = int(_flag(argv, "--data-parallel-size") or MAX_DP)
            for group, dp_rank, engine in _groups(client, settings, dp_size):
                # A DP rank on another node opened its engine under that node's launch id;
                # vLLM's API server answers only once every DP rank's engine core reported
                # ready to it, so that group's engine now is this deployment's.
                if engine.launch_id != settings.launch_id and not (dp_rank and engine.ready):
                    log.warning(
                        "engine-registry: group %s's engine is another launch's "
                        "(%s): not published",
                        group,
                        engine.launch_id,
                    )
                    continue
                bootstrap = f"{host}:{port + (dp_rank or 0)}"  # vLLM: base + DP rank
                body = {
                    "engine_id": engine.engine_id,
                    "url": url,
                    "model": model,
                    "dp_rank": dp_rank,
                    "bootstrap": bootstrap,
                }
                client.request("PUT", f"/tp-groups/{group}/engine/serving", json=body)
                published.append((group, engine.engine_id))
                log.info(
                    "engine-registry: published that group %s (engine %s) serves %s at %s",
                    group,
                    engine.engine_id,
                    model,
                    url,
                )
    except RegistryError as exc:
        log.warning("engine-registry: could not publish where this instance serves: %s", exc)
    if published:
        atexit.register(_withdraw, settings, published)


def _withdraw(settings: PluginSettings, published: list[tuple[str, str]]) -> None:
    try:
        with common.client(settings, timeout_s=2.0) as client:
            for group, engine_id in published:
                client.request(
                    "DELETE", f"/tp-groups/{group}/engine/serving", params={"engine_id": engine_id}
                )
    except RegistryError:
        pass  # its engine goes with the next launch, and its leases lapse


def serve_grpc_metrics(settings: PluginSettings, argv: Sequence[str]) -> int | None:
    """A gRPC-served instance's ``/metrics`` on ``ENGINE_REGISTRY_GRPC_METRICS_PORT`` (the
    address of ``--host``), when set; the port, else None."""
    port = settings.grpc_metrics_port
    if port is None or not grpc_served(argv[1:], argv[0] if argv else ""):
        return None
    from prometheus_client import start_http_server

    host = _flag(argv, "--host") or "0.0.0.0"
    start_http_server(port, addr=host)
    log.info("engine-registry: /metrics of this gRPC-served instance at %s:%s", host, port)
    return port


def start(settings: PluginSettings, argv: Sequence[str]) -> threading.Thread | None:
    """Publish from this process once it serves (not on a headless node)."""
    if "--headless" in argv:
        return None
    serve_grpc_metrics(settings, argv)
    thread = threading.Thread(
        target=publish_when_serving,
        args=(settings, list(argv)),
        name="engine-registry-serving",
        daemon=True,
    )
    thread.start()
    return thread
