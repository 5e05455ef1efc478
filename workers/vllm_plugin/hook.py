"""The hook into vLLM: `KVConnectorFactory.create_connector`, version-checked.

Why there: every KV connector of a vLLM process is made by that classmethod, looked up on the
class at call time, so one patch covers the worker side (`ensure_kv_transfer_initialized`, after
vLLM's own `_sync_engine_id_across_tp` when the running vLLM has it, so ours has the last word
whether or not that broadcast ran) and the scheduler side (`Scheduler.__init__` in the engine
core), and nothing is bound to a name imported earlier elsewhere.

As vLLM splits its NIXL connector into a scheduler half and a worker half, so does the plugin:
`workers.vllm_plugin.worker_side` (identity sync before the connector, agent publication after
its KV caches) and `workers.vllm_plugin.scheduler_side` (adopt the workers' engine_id).
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from registry_client.errors import Forbidden, RegistryError, Unauthorized
from workers.vllm_plugin import common
from workers.vllm_plugin.activation import SUPPORTED_VLLM_VERSIONS
from workers.vllm_plugin.common import log
from workers.vllm_plugin.compat import vllm_version
from workers.vllm_plugin.settings import (
    ENV_GROUP,
    ENV_LAUNCH,
    ENV_ROLE,
    ENV_TOKEN,
    ENV_URL,
    PluginConfigError,
    PluginSettings,
)

_PATCHED = "_engine_registry_patched"

__all__ = [
    "ENV_GROUP",
    "ENV_LAUNCH",
    "ENV_ROLE",
    "ENV_TOKEN",
    "PluginConfigError",
    "UnsupportedVllm",
    "check_token",
    "check_version",
    "install",
]


class UnsupportedVllm(RuntimeError):
    """The running vLLM is not one whose hook point this plugin knows."""


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
    settings = PluginSettings.from_env()
    if first:
        check_token(settings)
        from workers.vllm_plugin import metrics, serving

        metrics.serve_from_first_process()
        serving.start(settings, sys.argv)
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
    from workers.vllm_plugin import scheduler_side, worker_side

    original = KVConnectorFactory.__dict__["create_connector"].__func__

    def create_connector(cls: Any, config: Any, role: Any, kv_cache_config: Any) -> Any:
        kv = getattr(config, "kv_transfer_config", None)
        if kv is not None:
            if role == KVConnectorRole.WORKER:
                worker_side.worker_sync(config)
            elif role == KVConnectorRole.SCHEDULER:
                scheduler_side.scheduler_adopt(config)
        connector = original(cls, config, role, kv_cache_config)
        if kv is not None and role == KVConnectorRole.WORKER:
            worker_side.attach_publication(connector, config)
        return connector

    KVConnectorFactory.create_connector = classmethod(create_connector)
    setattr(KVConnectorFactory, _PATCHED, True)
    log.debug("engine-registry plugin active (pid %d)", os.getpid())


def check_token(settings: PluginSettings) -> None:
    """A token the registry refuses stops the launch in its first process, before vLLM loads
    anything (the workers would refuse too, with the same cause, minutes later)."""
    with common.client(settings, timeout_s=5.0) as client:
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
