"""Typed views of the registry's JSON documents (docs/api.md).

Parsing is tolerant of extra members (the contract lets the service add fields) and strict
about the ones the workers rely on: a missing required member raises `KeyError`/`TypeError`
at the boundary instead of surfacing later as a confusing transfer failure.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal

# The lease an agent asks for (``ttl_s``): whole seconds within these bounds, else the
# registry answers 422; the service's request model and the workers' settings all use these.
TTL_S_MIN = 5
TTL_S_MAX = 3600
TTL_S_DEFAULT = 30

Role = Literal["prefill", "decode", "both"]
CompatValue = str | int | float | bool
Compat = dict[str, CompatValue]


@dataclass(frozen=True)
class KvSpec:
    """Where a rank's KV cache lies: `base_addrs` regions of `num_blocks` x `block_len` bytes.

    One region per (layer, K|V), each laid out block-major and, inside a block, head-major
    (vLLM's HND layout), so a contiguous run of heads of one block is one descriptor.
    """

    mem_type: str
    device_id: int
    base_addrs: list[int]
    num_blocks: int
    block_len: int
    num_heads: int = 0
    # More members of the record, kept as given (the vLLM plugin's side channel, layout, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.extra,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "base_addrs": list(self.base_addrs),
            "num_blocks": self.num_blocks,
            "block_len": self.block_len,
            "num_heads": self.num_heads,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KvSpec:
        return cls(
            mem_type=str(data["mem_type"]),
            device_id=int(data.get("device_id", 0)),
            base_addrs=[int(a) for a in data["base_addrs"]],
            num_blocks=int(data["num_blocks"]),
            block_len=int(data["block_len"]),
            num_heads=int(data.get("num_heads", 0)),
            extra={k: v for k, v in data.items() if k not in _KV_MEMBERS},
        )


_KV_MEMBERS = frozenset(
    {"mem_type", "device_id", "base_addrs", "num_blocks", "block_len", "num_heads"}
)


@dataclass(frozen=True)
class EngineIdentity:
    """The engine_id a TP group's ranks agreed on (`workers.identity.sync_engine_id`)."""

    group_id: str
    engine_id: str
    generation: int
    registry_url: str
    launch_id: str
    # "registry": issued by the registry and cross-verified; "fallback": rank 0's id used
    # without the registry (unreachable, fallback allowed); "local": made up by this node.
    source: str = "registry"


@dataclass(frozen=True)
class Engine:
    group_id: str
    engine_id: str
    generation: int
    launch_id: str
    tp_size: int
    role: str
    compat: dict[str, Any]
    ready: bool
    registered_ranks: list[int]
    missing_ranks: list[int]
    created_at: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Engine:
        return cls(
            group_id=str(data["group_id"]),
            engine_id=str(data["engine_id"]),
            generation=int(data["generation"]),
            launch_id=str(data.get("launch_id", "")),
            tp_size=int(data["tp_size"]),
            role=str(data["role"]),
            compat=dict(data.get("compat") or {}),
            ready=bool(data.get("ready", False)),
            registered_ranks=[int(r) for r in data.get("registered_ranks", [])],
            missing_ranks=[int(r) for r in data.get("missing_ranks", [])],
            created_at=str(data.get("created_at", "")),
            raw=data,
        )


@dataclass(frozen=True)
class AgentRecord:
    """A registered agent as the registry answers it (without the metadata blob)."""

    engine_id: str
    agent_name: str
    host: str
    generation: int
    expires_at: str
    rank: int = -1
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentRecord:
        return cls(
            engine_id=str(data.get("engine_id", "")),
            agent_name=str(data["agent_name"]),
            host=str(data.get("host", "")),
            generation=int(data.get("generation", 0)),
            expires_at=str(data.get("expires_at", "")),
            rank=int(data.get("rank", -1)),
            raw=data,
        )


@dataclass(frozen=True)
class AgentItem:
    """One rank's agent in a batch registration (`PUT /tp-groups/{g}/engine/agents`)."""

    rank: int
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    host: str
    kv: KvSpec

    def to_json(self, ttl_s: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rank": self.rank,
            "engine_id": self.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "host": self.host,
            "kv": self.kv.to_json(),
        }
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return body


@dataclass(frozen=True)
class BatchRegistration:
    """What a batch registration answered: every rank's record, on one shared lease."""

    agents: list[AgentRecord]
    created_ranks: list[int]
    replaced_ranks: list[int]

    @property
    def expires_at(self) -> str:
        return self.agents[0].expires_at if self.agents else ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchRegistration:
        return cls(
            agents=[AgentRecord.from_json(a) for a in data["agents"]],
            created_ranks=[int(r) for r in data.get("created_ranks", [])],
            replaced_ranks=[int(r) for r in data.get("replaced_ranks", [])],
        )


@dataclass(frozen=True)
class RankExpiry:
    """A rank's renewed lease, as a batch heartbeat answers it."""

    rank: int
    expires_at: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankExpiry:
        return cls(rank=int(data["rank"]), expires_at=str(data["expires_at"]))


@dataclass(frozen=True)
class Target:
    """One prefill rank a decode rank must load, with its NIXL metadata."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    host: str
    kv: KvSpec
    expires_at: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Target:
        return cls(
            rank=int(data["rank"]),
            agent_name=str(data["agent_name"]),
            agent_metadata=base64.b64decode(data["agent_metadata"], validate=True),
            host=str(data.get("host", "")),
            kv=KvSpec.from_json(data["kv"]),
            expires_at=str(data.get("expires_at", "")),
        )


@dataclass(frozen=True)
class Handshake:
    engine_id: str
    group_id: str
    generation: int
    remote_tp_size: int
    tp_ratio: int
    targets: list[Target]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Handshake:
        return cls(
            engine_id=str(data["engine_id"]),
            group_id=str(data["group_id"]),
            generation=int(data["generation"]),
            remote_tp_size=int(data["remote_tp_size"]),
            tp_ratio=int(data["tp_ratio"]),
            targets=sorted((Target.from_json(t) for t in data["targets"]), key=lambda t: t.rank),
        )
