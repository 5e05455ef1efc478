"""The `torchrun` entrypoints' settings: `WORKERS_*` variables and flags, pydantic-settings.

`WorkerSettings` holds what both entrypoints read; `PrefillSettings` and `DecodeSettings` add
their own. Each field is a variable (`WORKERS_` + its name in capitals) and a flag (`--name`,
older spellings kept: `--registry`, `--token`); see `workers.config`. A new setting is a new
field here and a row in docs/configuration.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from registry_client.models import TTL_S_DEFAULT, TTL_S_MAX, TTL_S_MIN
from registry_client.tls import ClientTLS
from workers import config

# Flags kept from before the flags were derived from the fields (they come first in --help).
FLAG_ALIASES = {"registry_url": ["--registry"], "registry_token": ["--token"]}


class WorkerSettings(BaseSettings):
    """What every rank of both entrypoints reads."""

    model_config = SettingsConfigDict(env_prefix="WORKERS_", extra="ignore", env_ignore_empty=True)
    _tls: ClientTLS = PrivateAttr(default_factory=ClientTLS)

    registry_url: str = Field(
        "http://127.0.0.1:8080", description="the registry's URL; replicas comma-separated"
    )
    registry_token: str | None = Field(None, description="a bearer token with the worker role")
    registry_token_file: Path | None = Field(
        None, description="a file whose first line is the token (read when no token is set)"
    )
    registry_ca: Path | None = Field(
        None, description="PEM CA bundle for https:// URLs (default: the system trust store)"
    )
    registry_cert: Path | None = Field(None, description="PEM client certificate (mutual TLS)")
    registry_key: Path | None = Field(None, description="PEM key of the client certificate")
    group_id: str = Field(description="this TP group's id")
    advertise_host: str | None = Field(
        None,
        description="the address peers reach this rank at (default: the one routing to "
        "the registry)",
    )
    publish: Literal["per-node", "per-rank"] = Field(
        "per-node", description="per-node or per-rank (who registers the agents)"
    )
    model: str = Field("demo-model", description="the compat model name")
    num_layers: int = Field(2, ge=1, description="KV layers, an integer >= 1")
    num_blocks: int = Field(16, ge=1, description="KV blocks per rank, an integer >= 1")
    block_size: int = Field(16, ge=1, description="tokens per block, an integer >= 1")
    num_heads: int = Field(8, ge=1, description="KV heads of the model, an integer >= 1")
    head_size: int = Field(64, ge=1, description="an integer >= 1")
    dtype: str = Field("float16", description="a 2-byte torch dtype (float16, bfloat16)")
    device: str = Field("cpu", description="cpu (DRAM, gloo) or cuda (VRAM, NCCL)")
    ttl_s: int = Field(
        TTL_S_DEFAULT,
        ge=TTL_S_MIN,
        le=TTL_S_MAX,
        description=f"the agent lease: whole seconds, {TTL_S_MIN}-{TTL_S_MAX}",
    )
    timeout_s: float = Field(30.0, gt=0, description="each registry call's deadline: seconds > 0")
    collective_timeout_s: float = Field(
        120.0, gt=0, description="torch.distributed's collective timeout: seconds > 0"
    )
    engine_id_source: Literal["registry", "local"] = Field(
        "registry", description="registry, or local to reproduce the per-node engine_id bug"
    )
    allow_fallback: bool = Field(
        False, description="true to use rank 0's own id when the registry is unreachable"
    )
    report_dir: str | None = Field(None, description="a directory for one JSON report per rank")

    @model_validator(mode="after")
    def _token_from_file(self) -> WorkerSettings:
        if self.registry_token is None and self.registry_token_file is not None:
            path = self.registry_token_file
            self.registry_token = config.read_token_file(path, "WORKERS_REGISTRY_TOKEN_FILE")
        # A file that cannot be used: TLSConfigError, a ValueError naming the variable.
        self._tls = ClientTLS(self.registry_ca, self.registry_cert, self.registry_key)
        return self

    @property
    def tls(self) -> ClientTLS:
        """HTTPS to the registry: ``WORKERS_REGISTRY_CA``, ``_CERT``, ``_KEY``."""
        return self._tls


class PrefillSettings(WorkerSettings):
    serve_s: float = Field(300.0, gt=0, description="serve at most this long: seconds > 0")
    exit_after_notifs: int = Field(
        0, ge=0, description="exit once this many 'verified' notifications came (0: never)"
    )


class DecodeSettings(WorkerSettings):
    prefill_engine_id: str | None = Field(None, description="the prefill engine to read from")
    prefill_group: str | None = Field(
        None, description="read from this group's current engine (or --prefill-engine-id)"
    )
    read_blocks: int = Field(0, ge=0, description="blocks to read (0: all)")
    rounds: int = Field(1, ge=1, description="verified rounds to complete, >= 1")
    until_engines: int = Field(
        0,
        ge=0,
        description="keep going until blocks of this many distinct prefill engines verified",
    )
    round_interval_s: float = Field(0.2, ge=0, description="seconds between rounds, >= 0")
    handshake_timeout_s: float = Field(60.0, gt=0, description="seconds > 0")
    transfer_timeout_s: float = Field(10.0, gt=0, description="seconds > 0")
    deadline_s: float = Field(120.0, gt=0, description="give up after this: seconds > 0")

    @model_validator(mode="after")
    def _one_target(self) -> DecodeSettings:
        if (self.prefill_engine_id is None) == (self.prefill_group is None):
            raise ValueError(
                "give exactly one of --prefill-engine-id (WORKERS_PREFILL_ENGINE_ID) and "
                "--prefill-group (WORKERS_PREFILL_GROUP): the engine to read from, or the "
                "group whose current engine to follow"
            )
        return self


def parse_prefill(argv: list[str] | None, description: str | None) -> PrefillSettings:
    return config.parse(
        PrefillSettings,
        argv,
        prog="python -m workers.prefill",
        description=description,
        aliases=FLAG_ALIASES,
    )


def parse_decode(argv: list[str] | None, description: str | None) -> DecodeSettings:
    return config.parse(
        DecodeSettings,
        argv,
        prog="python -m workers.decode",
        description=description,
        aliases=FLAG_ALIASES,
    )
