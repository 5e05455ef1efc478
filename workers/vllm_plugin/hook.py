"""The hook into vLLM: `KVConnectorFactory.create_connector`, version-checked.

Why there: every KV connector of a vLLM process is made by that classmethod, looked up on the
class at call time, so one patch covers the worker side (`ensure_kv_transfer_initialized`, after
vLLM's own `_sync_engine_id_across_tp` when the running vLLM has it, so ours has the last word
whether or not that broadcast ran) and the scheduler side (`Scheduler.__init__` in the engine
core), and nothing is bound to a name imported earlier elsewhere.

Worker side (collective over vLLM's TP group, or its model-parallel world when PP > 1):
`workers.identity.sync_engine_id` opens (rank 0), fetches and cross-verifies the engine; any
disagreement raises the same `EngineIdentityError` on every rank, with its cause, and the
instance does not start. Scheduler side: re-opens the engine with the launch's `launch_id`
(the registry answers the same engine, it never opens a second one for a retried launch_id) so
the `remote_engine_id` handed to decode instances is the registry's.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from workers.client import RegistryClient
from workers.errors import (
    EngineIdentityError,
    Forbidden,
    RegistryError,
    Unauthorized,
)
from workers.identity import EngineIdentity, sync_engine_id
from workers.models import Role
from workers.tls import VARS_OF_PLUGIN, ClientTLS, TLSConfigError
from workers.vllm_plugin import ENV_URL, SUPPORTED_VLLM_VERSIONS
from workers.vllm_plugin.compat import compat_of, vllm_version
from workers.vllm_plugin.registration import Registration

# A child of vLLM's logger, so lines appear in vLLM's output with its prefixes (rank, pid).
log = logging.getLogger("vllm.engine_registry")

ENV_GROUP = "ENGINE_REGISTRY_GROUP"
ENV_TOKEN = "ENGINE_REGISTRY_TOKEN"
ENV_ROLE = "ENGINE_REGISTRY_ROLE"
ENV_TTL = "ENGINE_REGISTRY_TTL_S"
ENV_TIMEOUT = "ENGINE_REGISTRY_TIMEOUT_S"
ENV_LAUNCH = "ENGINE_REGISTRY_LAUNCH_ID"
ENV_REFUSE_EXIT = "ENGINE_REGISTRY_REFUSE_EXIT_S"

_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_PATCHED = "_engine_registry_patched"


class UnsupportedVllm(RuntimeError):
    """The running vLLM is not one whose hook point this plugin knows."""


class PluginConfigError(RuntimeError):
    """The plugin is active but its environment is incomplete or wrong."""


@dataclass(frozen=True)
class Settings:
    urls: str
    group: str
    token: str | None
    role: Role | None
    ttl_s: int
    timeout_s: float
    launch_id: str
    refuse_exit_s: float = 10.0
    tls: ClientTLS = field(default_factory=lambda: ClientTLS.from_env(VARS_OF_PLUGIN, {}))

    @classmethod
    def from_env(cls) -> Settings:
        urls = os.environ.get(ENV_URL, "").strip()
        group = os.environ.get(ENV_GROUP, "").strip()
        if not group:
            raise PluginConfigError(
                f"engine-registry plugin: {ENV_URL} is set ({urls}) but {ENV_GROUP} is not; "
                f"name the TP group this instance serves (or unset {ENV_URL})"
            )
        role_name = os.environ.get(ENV_ROLE, "").strip() or None
        if role_name is not None and role_name not in ("prefill", "decode", "both"):
            raise PluginConfigError(
                f"engine-registry plugin: {ENV_ROLE}={role_name!r}: use prefill, decode or both"
            )
        role: Role | None = None
        if role_name == "prefill":
            role = "prefill"
        elif role_name == "decode":
            role = "decode"
        elif role_name == "both":
            role = "both"
        try:  # ENGINE_REGISTRY_CA, ENGINE_REGISTRY_CERT, ENGINE_REGISTRY_KEY
            tls = ClientTLS.from_env(VARS_OF_PLUGIN)
        except TLSConfigError as exc:
            raise PluginConfigError(f"engine-registry plugin: {exc}") from None
        return cls(
            urls=urls,
            group=group,
            token=os.environ.get(ENV_TOKEN) or None,
            role=role,
            ttl_s=int(os.environ.get(ENV_TTL, "30")),
            timeout_s=float(os.environ.get(ENV_TIMEOUT, "30")),
            launch_id=os.environ[ENV_LAUNCH],
            refuse_exit_s=float(os.environ.get(ENV_REFUSE_EXIT, "10")),
            tls=tls,
        )


@dataclass
class _State:
    """What this process learned; one sync per process (sub-connectors reuse it)."""

    identity: EngineIdentity | None = None
    engine_id: str = ""  # what vLLM uses: the registry's id, plus `_dp{rank}` under DP
    group_id: str = ""
    rank: int = 0
    size: int = 1
    registration: Registration | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def check_version(version: str | None = None) -> None:
    """Fail at start, clearly, on a vLLM whose hook point this plugin does not know."""
    version = version or vllm_version()
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllm(
            f"engine-registry vLLM plugin: vLLM {version} is not supported (supported: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}). The plugin hooks "
            "KVConnectorFactory.create_connector and reads the NIXL connector's worker; "
            f"unset {ENV_URL} to run this vLLM without the registry."
        )


def install() -> None:
    """Check the version, fix this launch's launch_id, patch the connector factory (once)."""
    check_version()
    # The first process of a launch (the API server, or a headless node's launcher) names
    # the launch; its engine core and workers inherit it through the environment.
    first = ENV_LAUNCH not in os.environ
    os.environ.setdefault(ENV_LAUNCH, uuid.uuid4().hex)
    settings = Settings.from_env()
    if first:
        check_token(settings)
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    except ImportError as exc:  # pragma: no cover - guarded by the version check
        raise UnsupportedVllm(
            f"engine-registry vLLM plugin: vLLM {vllm_version()} has no "
            f"KVConnectorFactory/KVConnectorRole where expected ({exc}); supported: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}"
        ) from exc
    if getattr(KVConnectorFactory, _PATCHED, False):
        return
    original = KVConnectorFactory.__dict__["create_connector"].__func__

    def create_connector(cls: Any, config: Any, role: Any, kv_cache_config: Any) -> Any:
        kv = getattr(config, "kv_transfer_config", None)
        if kv is not None:
            if role == KVConnectorRole.WORKER:
                _worker_sync(config)
            elif role == KVConnectorRole.SCHEDULER:
                _scheduler_adopt(config)
        connector = original(cls, config, role, kv_cache_config)
        if kv is not None and role == KVConnectorRole.WORKER:
            _attach_registration(connector, config)
        return connector

    KVConnectorFactory.create_connector = classmethod(create_connector)
    setattr(KVConnectorFactory, _PATCHED, True)
    log.debug("engine-registry plugin active (pid %d)", os.getpid())


def check_token(settings: Settings) -> None:
    """A token the registry refuses stops the launch in its first process, before vLLM loads
    anything (the workers would refuse too, with the same cause, minutes later)."""
    with RegistryClient(
        settings.urls, token=settings.token, timeout_s=5.0, tls=settings.tls
    ) as client:
        try:
            client.request("GET", f"/tp-groups/{settings.group}/engine")
        except (Unauthorized, Forbidden) as exc:
            raise PluginConfigError(
                f"engine-registry: group {settings.group!r} refuses to start: unauthorized: "
                f"registry {client.url} refused {ENV_TOKEN} ({exc}); set it to a token with "
                "the worker role from the registry's tokens file"
            ) from exc
        except RegistryError:
            return  # no engine yet, or unreachable: the workers' sync decides, with its cause


# -- what every side computes the same way --------------------------------------------------


def _client(settings: Settings) -> RegistryClient:
    return RegistryClient(
        settings.urls, token=settings.token, timeout_s=settings.timeout_s, tls=settings.tls
    )


def _role(config: Any, settings: Settings) -> Role:
    if settings.role is not None:
        return settings.role
    return _ROLES.get(str(config.kv_transfer_config.kv_role), "both")


def _group_id(config: Any, settings: Settings) -> tuple[str, int, int]:
    parallel = config.parallel_config
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    group = settings.group if dp_size == 1 else f"{settings.group}-dp{dp_rank}"
    return group, dp_size, dp_rank


def _vllm_engine_id(registry_id: str, dp_size: int, dp_rank: int) -> str:
    # vLLM's convention for data parallelism (v1/engine/core.py): one id per DP rank.
    return registry_id if dp_size == 1 else f"{registry_id}_dp{dp_rank}"


# -- worker side ---------------------------------------------------------------------------


def _worker_sync(config: Any) -> None:
    with _state.lock:
        if _state.identity is not None:
            config.kv_transfer_config.engine_id = _state.engine_id
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group

        settings = Settings.from_env()
        group_id, dp_size, dp_rank = _group_id(config, settings)
        tp = get_tp_group()
        pp = get_pp_group()
        tp_rank, pp_rank = int(tp.rank_in_group), int(pp.rank_in_group)
        if pp.world_size == 1:
            pg, size = tp.cpu_group, int(tp.world_size)
        elif dp_size == 1:
            # PP > 1: one engine over every stage; the world is this instance's TP x PP ranks.
            world = get_world_group()
            pg, size = world.cpu_group, int(world.world_size)
        else:
            raise PluginConfigError(
                "engine-registry plugin: pipeline and data parallelism together are not "
                "supported yet (no process group spans one DP replica's stages)"
            )
        rank = pp_rank * int(tp.world_size) + tp_rank
        role = _role(config, settings)
        before = config.kv_transfer_config.engine_id
        client = _client(settings)
        try:
            identity = sync_engine_id(
                client,
                group_id,
                tp_size=size,
                role=role,
                compat=compat_of(config),
                group=pg,
                cpu_group=pg,
                launch_id=settings.launch_id,
                timeout_s=settings.timeout_s,
            )
        except EngineIdentityError as exc:
            log.error(
                "engine-registry: rank %d of group %r refuses to start: %s", rank, group_id, exc
            )
            client.close()
            _exit_soon(settings.refuse_exit_s)
            raise RuntimeError(
                f"engine-registry: group {group_id!r} rank {rank} refuses to start: {exc}"
            ) from exc
        engine_id = _vllm_engine_id(identity.engine_id, dp_size, dp_rank)
        config.kv_transfer_config.engine_id = engine_id
        _state.identity = identity
        _state.engine_id = engine_id
        _state.group_id = group_id
        _state.rank = rank
        _state.size = size
        client.close()
        log.info(
            "engine-registry: rank %d/%d (tp_rank %d, pp_rank %d) of group %r uses the "
            "registry's engine_id %s (generation %d, was %s)",
            rank,
            size,
            tp_rank,
            pp_rank,
            group_id,
            engine_id,
            identity.generation,
            before,
        )


def _exit_soon(delay_s: float) -> None:
    """Make sure a worker that refused its identity never lingers.

    The raise below reaches vLLM's driver as the failed RPC, and node 0's engine core stops.
    A headless node's worker, though, answers the failure and waits for the next RPC from a
    driver that is gone, and its launcher waits on it. So the refusing worker exits on its own
    once the error had time to travel; vLLM's worker monitor then stops that node too.
    """

    def leave() -> None:
        time.sleep(delay_s)
        log.error("engine-registry: exiting this worker (it refused its engine identity)")
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=leave, name="engine-registry-refused", daemon=True).start()


# -- scheduler side ------------------------------------------------------------------------


def _scheduler_adopt(config: Any) -> None:
    settings = Settings.from_env()
    group_id, dp_size, dp_rank = _group_id(config, settings)
    parallel = config.parallel_config
    size = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    with _client(settings) as client:
        try:
            engine, created = client.open_engine(
                group_id,
                launch_id=settings.launch_id,
                tp_size=size,
                role=_role(config, settings),
                timeout_s=settings.timeout_s,
            )
        except RegistryError as exc:
            raise RuntimeError(
                f"engine-registry: the scheduler of group {group_id!r} could not adopt its "
                f"engine (launch {settings.launch_id}): {exc}"
            ) from exc
    if created:
        raise RuntimeError(
            f"engine-registry: the scheduler of group {group_id!r} found no engine opened by "
            f"its workers for launch {settings.launch_id} (it opened generation "
            f"{engine.generation} itself): were the workers started without the plugin?"
        )
    engine_id = _vllm_engine_id(engine.engine_id, dp_size, dp_rank)
    config.kv_transfer_config.engine_id = engine_id
    log.info(
        "engine-registry: scheduler of group %r uses the registry's engine_id %s (generation %d)",
        group_id,
        engine_id,
        engine.generation,
    )


# -- agent registration, lease, deregistration --------------------------------------------


def side_channel() -> tuple[str, int]:
    """Where this instance serves NIXL handshakes (vLLM's scheduler, for every rank)."""
    host = (
        os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        or os.environ.get("VLLM_HOST_IP")
        or "127.0.0.1"
    )
    return host, int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))


def agent_body(connector: Any, config: Any) -> dict[str, Any]:
    """The registry's agent record for this rank: NIXL agent when exposed, else side channel."""
    host, port = side_channel()
    dp_index = int(getattr(config.parallel_config, "data_parallel_index", 0) or 0)
    worker = getattr(connector, "connector_worker", None)
    agent = getattr(worker, "nixl_wrapper", None)
    kv: dict[str, Any] = {
        "mem_type": "DRAM",
        "device_id": 0,
        "base_addrs": [],
        "num_blocks": 1,
        "block_len": 1,
        "side_channel_host": host,
        "side_channel_port": port + dp_index,
        "vllm_engine_id": _state.engine_id,
        "kv_connector": type(connector).__name__,
        "rank": _state.rank,
    }
    name = f"{_state.engine_id}-rank{_state.rank}"
    metadata = b"no-nixl-agent"
    if worker is not None and agent is not None:
        name = str(getattr(agent, "name", name))
        metadata = bytes(agent.get_agent_metadata())
        kv["device_id"] = int(getattr(worker, "device_id", 0) or 0)
        addrs = getattr(worker, "kv_caches_base_addr", {}).get(worker.engine_id, {})
        kv["base_addrs"] = [int(a) for a in addrs.get(worker.tp_rank, [])]
        kv["num_blocks"] = max(1, int(getattr(worker, "num_blocks", 1) or 1))
        lens = list(getattr(worker, "block_len_per_layer", []) or [1])
        kv["block_len"] = max(1, int(lens[0]))
        kv["kv_cache_layout"] = str(getattr(worker, "kv_cache_layout", ""))
        kv["tp_rank"] = int(worker.tp_rank)
    return {
        "engine_id": _state.identity.engine_id if _state.identity else _state.engine_id,
        "agent_name": name,
        "agent_metadata": base64.b64encode(metadata).decode("ascii"),
        "host": host,
        "kv": kv,
    }


def _attach_registration(connector: Any, config: Any) -> None:
    """Register this rank's agent once its KV caches are registered with the connector."""
    if _state.identity is None or _state.registration is not None:
        return
    register_kv_caches = connector.register_kv_caches
    shutdown = getattr(connector, "shutdown", None)

    def register_then_publish(*args: Any, **kwargs: Any) -> Any:
        result = register_kv_caches(*args, **kwargs)
        if _state.registration is None:
            settings = Settings.from_env()
            registration = Registration(
                _client(settings),
                settings.ttl_s,
                _state.group_id,
                _state.rank,
                agent_body(connector, config),
            )
            try:
                registration.start()
            except RegistryError as exc:
                raise RuntimeError(
                    f"engine-registry: rank {_state.rank} of group {_state.group_id!r} could "
                    f"not register its agent: {exc}"
                ) from exc
            _state.registration = registration
        return result

    def deregister_then_shutdown(*args: Any, **kwargs: Any) -> Any:
        if _state.registration is not None:
            _state.registration.close()
        return shutdown(*args, **kwargs) if shutdown is not None else None

    connector.register_kv_caches = register_then_publish
    if shutdown is not None:
        connector.shutdown = deregister_then_shutdown
