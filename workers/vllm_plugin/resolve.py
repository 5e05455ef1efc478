"""Decode-side: from vLLM's `kv_transfer_params` to the prefill instance, through the registry.

A prefill instance running the plugin hands out `remote_engine_id` = the registry's engine_id
(with vLLM's `_dp{rank}` suffix under data parallelism). `resolve_remote_engine` strips the
suffix, resolves the id (`GET /engines/{id}`: the Engine, 410 when a relaunch superseded it,
404 when this registry never issued it) and, for an engine that serves KV (role prefill or
both), lists its ranks' agents with where their side channel is (`POST /engines/{id}/handshake`
as each rank of a decode group of the same TP size, so every target comes back once).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from registry_client.client import RegistryClient
from registry_client.errors import Incompatible, NotReady
from registry_client.models import Engine
from registry_client.paths import engine_path

_DP_SUFFIX = re.compile(r"^(?P<id>.+?)_dp(?P<rank>\d+)$")


def split_dp_suffix(engine_id: str) -> tuple[str, int | None]:
    """`"<id>_dp3"` -> `("<id>", 3)`; an id without the suffix -> `(id, None)`."""
    match = _DP_SUFFIX.match(engine_id)
    if match is None:
        return engine_id, None
    return match.group("id"), int(match.group("rank"))


@dataclass(frozen=True)
class RemoteAgent:
    """One rank's agent record; `kv` as registered, the plugin's extra keys included."""

    rank: int
    agent_name: str
    host: str
    kv: dict[str, Any]
    expires_at: str = ""

    @property
    def side_channel(self) -> tuple[str, int]:
        """(host, port) of the NIXL side channel that serves this rank's handshake."""
        return str(self.kv.get("side_channel_host", self.host)), int(
            self.kv.get("side_channel_port", 0)
        )


@dataclass(frozen=True)
class RemoteInstance:
    engine: Engine
    dp_rank: int | None
    agents: list[RemoteAgent] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)

    def side_channels(self) -> dict[int, tuple[str, int]]:
        return {agent.rank: agent.side_channel for agent in self.agents}


def resolve_remote_engine(
    client: RegistryClient,
    params: Mapping[str, Any] | str,
    *,
    with_agents: bool = True,
    timeout_s: float | None = None,
) -> RemoteInstance:
    """Resolve `kv_transfer_params` (or a bare `remote_engine_id`) to its instance.

    Raises `EngineSuperseded` (the instance was relaunched: `current_engine_id` names the
    new one) or `NotFound` (not an id this registry issued) from `registry_client.errors`.
    """
    engine_id = str(params if isinstance(params, str) else params["remote_engine_id"])
    base, dp_rank = split_dp_suffix(engine_id)
    engine = client.resolve_engine(base, timeout_s=timeout_s)
    agents: list[RemoteAgent] = []
    missing: list[int] = []
    if with_agents and engine.role != "decode":
        for rank in range(engine.tp_size):
            try:
                r = client.request(
                    "POST",
                    f"{engine_path(base)}/handshake",
                    json={"tp_size": engine.tp_size, "rank": rank},
                    timeout_s=timeout_s,
                )
            except NotReady as exc:
                missing.extend(exc.missing_ranks or [rank])
                continue
            except Incompatible:
                break
            agents.extend(
                RemoteAgent(
                    rank=int(item["rank"]),
                    agent_name=str(item["agent_name"]),
                    host=str(item.get("host", "")),
                    kv=dict(item.get("kv") or {}),
                    expires_at=str(item.get("expires_at", "")),
                )
                for item in r.json()["targets"]
            )
    return RemoteInstance(engine, dp_rank, agents, sorted(set(missing)))
