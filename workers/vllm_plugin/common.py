"""What the scheduler side and the worker side compute the same way: the registry client,
the instance's role, its group id and the engine_id vLLM uses (data parallelism included)."""

from __future__ import annotations

import logging
from typing import Any

from workers.client import RegistryClient
from workers.models import Role
from workers.vllm_plugin.settings import PluginSettings

# A child of vLLM's logger, so lines appear in vLLM's output with its prefixes (rank, pid).
log = logging.getLogger("vllm.engine_registry")

_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def client(settings: PluginSettings, timeout_s: float | None = None) -> RegistryClient:
    """The plugin's one way to reach the registry (URLs, token, deadline)."""
    return RegistryClient(
        settings.urls,
        token=settings.token,
        timeout_s=timeout_s or settings.timeout_s,
        tls=settings.tls,
    )


def role(config: Any, settings: PluginSettings) -> Role:
    if settings.role is not None:
        return settings.role
    return _ROLES.get(str(config.kv_transfer_config.kv_role), "both")


def group_id(config: Any, settings: PluginSettings) -> tuple[str, int, int]:
    """(registry group, DP size, DP rank): one registry group per data-parallel rank."""
    parallel = config.parallel_config
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    group = settings.group if dp_size == 1 else f"{settings.group}-dp{dp_rank}"
    return group, dp_size, dp_rank


def vllm_engine_id(registry_id: str, dp_size: int, dp_rank: int) -> str:
    # vLLM's convention for data parallelism (v1/engine/core.py): one id per DP rank.
    return registry_id if dp_size == 1 else f"{registry_id}_dp{dp_rank}"
