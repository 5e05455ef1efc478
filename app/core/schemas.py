"""The wire shapes of docs/api.md. Request models are strict: wrong JSON types, unknown
top-level fields and out-of-range values are refused (422) before anything is touched."""

from __future__ import annotations

import binascii
from typing import Annotated, Any, Literal

import pybase64
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    field_validator,
    model_validator,
)

from app.core.addresses import (
    bootstrap_address,
    parse_host,
    printable,
    serving_url,
    unspecified,
)
from app.core.budgets import MAX_TEXT, too_long
from registry_client.models import TTL_S_DEFAULT, TTL_S_MAX, TTL_S_MIN

GROUP_ID_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$"
# The engine ids this registry issues (UUIDs) and a client may name in a path: URL-unreserved
# characters only, so no escaping changes them (registry_client/paths.py refuses any other).
ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._~-]{0,127}$"
# What one group may hold (docs/operations.md, "Group limits"): its change is one watch line
# of at most MAX_TP_SIZE agents of MAX_AGENT_NAME + MAX_HOST characters each.
MAX_TP_SIZE = 1024
MAX_AGENT_NAME = 128
MAX_HOST = 253  # a DNS name's own limit
MAX_DP_RANK = 65536
MAX_COMPAT_KEYS = 32
# What a KV description may claim (docs/api.md, "kv"): a decode sizes its descriptor lists
# (num_blocks x regions) by these numbers, so absurd ones are refused here.
MAX_KV_REGIONS = 4096
MAX_NUM_BLOCKS = 2**24
MAX_BLOCK_LEN = 2**32
MAX_KV_DESCRIPTORS = 2**27  # num_blocks x regions
MAX_REGION_BYTES = 2**44  # num_blocks x block_len: 16 TiB

GroupId = Annotated[str, StringConstraints(pattern=GROUP_ID_PATTERN)]
Role = Literal["prefill", "decode", "both"]
CompatValue = (
    StrictBool
    | StrictInt
    | Annotated[StrictFloat, Field(allow_inf_nan=False)]
    | Annotated[StrictStr, StringConstraints(max_length=MAX_TEXT)]
)
CompatKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Compat = Annotated[dict[CompatKey, CompatValue], Field(max_length=MAX_COMPAT_KEYS)]
TpSize = Annotated[StrictInt, Field(ge=1, le=MAX_TP_SIZE)]
Rank = Annotated[StrictInt, Field(ge=0, lt=MAX_TP_SIZE)]
Token = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
MemType = Literal["DRAM", "VRAM", "BLK", "OBJ", "FILE"]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class OpenEngineRequest(_Request):
    launch_id: Token
    tp_size: TpSize
    role: Role
    compat: Compat | None = None


class KvDescription(BaseModel):
    """Where a rank's KV cache lives. Extra keys (layouts, per-layer lists) are kept as given."""

    model_config = ConfigDict(strict=True, extra="allow")

    mem_type: MemType
    device_id: Annotated[StrictInt, Field(ge=0, lt=65536)]
    base_addrs: Annotated[
        list[Annotated[StrictInt, Field(ge=0, lt=2**64)]], Field(max_length=MAX_KV_REGIONS)
    ]
    num_blocks: Annotated[StrictInt, Field(ge=1, le=MAX_NUM_BLOCKS)]
    block_len: Annotated[StrictInt, Field(ge=1, le=MAX_BLOCK_LEN)]

    @model_validator(mode="after")
    def _text_budget(self) -> KvDescription:
        descriptors = self.num_blocks * max(1, len(self.base_addrs))
        if descriptors > MAX_KV_DESCRIPTORS:
            raise ValueError(
                f"kv describes {descriptors} blocks (num_blocks x base_addrs), more than "
                f"{MAX_KV_DESCRIPTORS}: a decode would size its transfer descriptors by it"
            )
        if self.num_blocks * self.block_len > MAX_REGION_BYTES:
            raise ValueError(
                f"kv regions of {self.num_blocks} blocks of {self.block_len} bytes exceed "
                f"{MAX_REGION_BYTES} bytes (16 TiB) each"
            )
        where = too_long(self.__pydantic_extra__ or {})
        if where is not None:
            raise ValueError(
                f"kv.{where} is longer than {MAX_TEXT} characters (the budget of every "
                "free-form string the registry keeps)"
            )
        return self


class Base64Text(str):
    """Base64 text as the client sent it, with the bytes it stands for: decoded once, strictly,
    by the validator (decoding a 256 KiB blob costs as much as the rest of a registration)."""

    data: bytes


def strict_base64(text: str) -> bytes:
    """``binascii.a2b_base64(text, strict_mode=True)``, at a fifteenth of its cost.

    pybase64 (SIMD) decodes a 5 KiB blob in about 1 µs against CPython's 15; it refuses a
    little more than ``binascii``'s strict mode does (``"QUJD="``: padding past a full
    quad), so what it refuses is decided by ``binascii``, and the text accepted and the bytes
    are exactly ``binascii``'s (``tests/app/test_one_pass_bodies.py`` checks both on a corpus
    of near misses)."""
    try:
        return pybase64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error too; non-ASCII text
        return binascii.a2b_base64(text, strict_mode=True)


def blob_of(text: str) -> bytes:
    """The bytes of a validated ``agent_metadata``."""
    return text.data if isinstance(text, Base64Text) else binascii.a2b_base64(text)


class RegisterAgentRequest(_Request):
    engine_id: Token
    agent_name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_AGENT_NAME)]
    agent_metadata: Annotated[str, StringConstraints(min_length=1)]
    host: Annotated[str, StringConstraints(min_length=1, max_length=MAX_HOST)]
    kv: KvDescription
    ttl_s: Annotated[StrictInt, Field(ge=TTL_S_MIN, le=TTL_S_MAX)] = TTL_S_DEFAULT

    @field_validator("agent_metadata")
    @classmethod
    def _base64(cls, value: str) -> str:
        text = Base64Text(value)
        try:
            text.data = strict_base64(value)
        except binascii.Error as exc:
            raise ValueError(f"agent_metadata is not valid base64 ({exc})") from None
        return text

    @field_validator("agent_name")
    @classmethod
    def _name(cls, value: str) -> str:
        return printable(value, "agent_name")

    @field_validator("host")
    @classmethod
    def _routable(cls, value: str) -> str:
        if unspecified(parse_host(value)):
            raise ValueError(
                f"host {value!r} is unspecified: advertise the address peers can reach "
                "(the one that routes to the registry), not a wildcard"
            )
        return value


class EngineIdBody(_Request):
    engine_id: Token


class DecodeSide(_Request):
    """Who asks for a handshake: the decode group and its engine (for events and pages)."""

    group_id: GroupId
    engine_id: Token | None = None


class HandshakeRequest(_Request):
    tp_size: TpSize
    rank: Rank
    compat: Compat | None = None
    decode: DecodeSide | None = None

    @model_validator(mode="after")
    def _rank_in_group(self) -> HandshakeRequest:
        if self.rank >= self.tp_size:
            raise ValueError(f"rank {self.rank} must be below tp_size {self.tp_size}")
        return self


class ServingRequest(_Request):
    """Where an instance serves, published once its API answers (docs/api.md "Instances")."""

    engine_id: Token
    url: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT)]
    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    dp_rank: Annotated[StrictInt, Field(ge=0, lt=MAX_DP_RANK)] | None = None
    bootstrap: Annotated[str, StringConstraints(min_length=3, max_length=260)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return serving_url(value)  # stored as validated: normalized, never the raw text

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        return printable(value, "model")

    @field_validator("bootstrap")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return None if value is None else bootstrap_address(value)


MAX_PP_SIZE = 1024


class MooncakeRegistration(_Request):
    """What vLLM's MooncakeConnector prefill workers post to ``/register`` (docs/api.md
    "Mooncake bootstrap"): the fields and types of its ``RegisterWorkerPayload``."""

    engine_id: Annotated[str, StringConstraints(pattern=ENGINE_ID_PATTERN)]
    dp_rank: Annotated[StrictInt, Field(ge=0, lt=MAX_DP_RANK)]
    tp_rank: Annotated[StrictInt, Field(ge=0, lt=MAX_TP_SIZE)]
    pp_rank: Annotated[StrictInt, Field(ge=0, lt=MAX_PP_SIZE)]
    addr: Annotated[str, StringConstraints(min_length=9, max_length=266)]

    @field_validator("addr")
    @classmethod
    def _tcp_host_port(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme.lower() != "tcp":
            raise ValueError("addr must be tcp://host:port (the sender's ZMQ side channel)")
        return "tcp://" + bootstrap_address(rest)


# -- answers ---------------------------------------------------------------------------------


class Serving(BaseModel):
    url: str = Field(description="The instance's OpenAI API, as a router reaches it.")
    model: str
    dp_rank: int | None = None
    bootstrap: str | None = Field(None, description="host:port of its side channel (if any).")
    published_at: str
    published_by: str | None = Field(
        None, description="The name of the token that published it (null without tokens)."
    )


class AgentSummary(BaseModel):
    rank: int
    agent_name: str
    host: str
    expires_at: str


class Engine(BaseModel):
    group_id: str
    engine_id: str
    generation: int
    launch_id: str
    tp_size: int
    role: Role
    compat: dict[str, Any]
    created_at: str
    opened_by: str | None = Field(
        None, description="The name of the token that opened this launch (null without tokens)."
    )
    ready: bool
    registered_ranks: list[int]
    missing_ranks: list[int]
    agents: list[AgentSummary] = Field(
        default_factory=list, description="Live agents (no metadata blobs), by rank."
    )
    serving: Serving | None = Field(
        None, description="Where this engine's instance serves, once it published it."
    )


class Agent(BaseModel):
    engine_id: str
    generation: int
    rank: int
    agent_name: str
    host: str
    kv: dict[str, Any]
    ttl_s: int
    registered_at: str
    registered_by: str | None = Field(
        None, description="The name of the token that registered it (null without tokens)."
    )
    expires_at: str


class Heartbeat(BaseModel):
    expires_at: str


class Target(BaseModel):
    rank: int
    agent_name: str
    agent_metadata: str
    host: str
    kv: dict[str, Any]
    expires_at: str


class Handshake(BaseModel):
    engine_id: str
    group_id: str
    generation: int
    remote_tp_size: int
    tp_ratio: int
    targets: list[Target]


class Groups(BaseModel):
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    groups: list[Engine]
    revision: int = Field(
        0, description="The store revision the list was read at: watch from it for what follows."
    )
    continue_: str | None = Field(
        None,
        alias="continue",
        description="Pass as ?continue= for the next page (same snapshot); null on the last.",
    )


# -- batches: the ranks of a node (or a group) in one request --------------------------------

MAX_BATCH = 1024


class AgentItem(RegisterAgentRequest):
    """One rank's registration inside a batch: the per-rank body plus its ``rank``."""

    rank: Rank


class RegisterAgentsRequest(_Request):
    agents: Annotated[list[AgentItem], Field(min_length=1, max_length=MAX_BATCH)]

    @model_validator(mode="after")
    def _one_lease(self) -> RegisterAgentsRequest:
        ranks = [a.rank for a in self.agents]
        if len(set(ranks)) != len(ranks):
            raise ValueError("each rank may appear once in a batch")
        if len({a.ttl_s for a in self.agents}) != 1:
            raise ValueError("every agent of a batch shares one lease: give them one ttl_s")
        return self


class Agents(BaseModel):
    agents: list[Agent]
    created_ranks: list[int] = Field(description="Ranks that had no live agent before.")
    replaced_ranks: list[int] = Field(description="Ranks whose live agent this replaced.")


class HeartbeatsRequest(_Request):
    engine_id: Token
    ranks: Annotated[list[Rank], Field(min_length=1, max_length=MAX_BATCH)]

    @model_validator(mode="after")
    def _distinct(self) -> HeartbeatsRequest:
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError("each rank may appear once in a batch heartbeat")
        return self


class RankExpiry(BaseModel):
    rank: int
    expires_at: str


class Heartbeats(BaseModel):
    agents: list[RankExpiry]
