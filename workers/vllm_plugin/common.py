"""What the scheduler side and the worker side compute the same way: the registry client,
the instance's role, its group id and the engine_id vLLM uses (data parallelism included)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from registry_client.client import RegistryClient
from registry_client.models import Role
from registry_client.transport import USER_AGENT
from workers.vllm_plugin.settings import PluginSettings

# A child of vLLM's logger, so lines appear in vLLM's output with its prefixes (rank, pid).
log = logging.getLogger("vllm.engine_registry")

_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def client(settings: PluginSettings, timeout_s: float | None = None) -> RegistryClient:
    """The plugin's one way to reach the registry (URLs, token, deadline, `user_agent`)."""
    return RegistryClient(
        settings.urls,
        token=settings.token,
        timeout_s=timeout_s or settings.timeout_s,
        tls=settings.tls,
        user_agent=user_agent(settings),
    )


def node_name(config: Any = None) -> str:
    """This process's node: its host and vLLM's node rank (``parallel_config.node_rank``,
    else ``--node-rank`` on the command line, which vLLM's worker processes inherit)."""
    rank: Any = getattr(getattr(config, "parallel_config", None), "node_rank", None)
    if rank is None:
        argv = sys.argv
        for i, arg in enumerate(argv):
            if arg == "--node-rank" and i + 1 < len(argv):
                rank = argv[i + 1]
            elif arg.startswith("--node-rank="):
                rank = arg.split("=", 1)[1]
    try:
        number = int(rank or 0)
    except ValueError:
        number = 0
    return f"{socket.gethostname()}/{number}"


def user_agent(settings: PluginSettings) -> str:
    """Who asks, for the registry's access log: the requests of one node of one group are
    counted from there (the real-vLLM tier's summary does)."""
    node = _node or node_name()
    return f"{USER_AGENT} vllm-plugin (group {settings.group}; node {node}; pid {os.getpid()})"


_node: str | None = None  # a worker's node, from its config (`set_node`)


def set_node(name: str) -> None:
    global _node
    _node = name


def role(config: Any, settings: PluginSettings) -> Role:
    if settings.role is not None:
        return settings.role
    return _ROLES.get(str(config.kv_transfer_config.kv_role), "both")


def dp_rank(config: Any) -> int | None:
    """This engine's global data-parallel rank, or None when vLLM runs no data parallelism.

    vLLM 0.32 runs a dense model's DP ranks as independent engines: its engine core appends
    `_dp{rank}` to the KV engine_id, then sets `data_parallel_size` 1 and `data_parallel_rank`
    0 (`ParallelConfig.reconfigure_for_independent_dp_rank`); only `data_parallel_index` (the
    global rank) and that suffix are left. An MoE model's ranks keep the DP fields.
    """
    parallel = config.parallel_config
    size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    index = getattr(parallel, "data_parallel_index", None)
    rank = int(index if index is not None else getattr(parallel, "data_parallel_rank", 0) or 0)
    if size > 1:
        return rank
    kv = getattr(config, "kv_transfer_config", None)
    engine_id = str(getattr(kv, "engine_id", "") or "")
    return rank if engine_id.endswith(f"_dp{rank}") else None


def group_id(config: Any, settings: PluginSettings) -> tuple[str, int | None]:
    """(registry group, DP rank or None): one registry group per data-parallel rank,
    named with the global rank, the same on every process of that rank."""
    rank = dp_rank(config)
    group = settings.group if rank is None else f"{settings.group}-dp{rank}"
    return group, rank


def vllm_engine_id(registry_id: str, dp_rank: int | None) -> str:
    # vLLM's convention for data parallelism (v1/engine/core.py): one id per DP rank.
    return registry_id if dp_rank is None else f"{registry_id}_dp{dp_rank}"
