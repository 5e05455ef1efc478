"""What the scheduler side and the worker side compute the same way: the registry client,
the instance's role, its group id and the engine_id vLLM uses (data parallelism included)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from workers.client import USER_AGENT, RegistryClient
from workers.models import Role
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
