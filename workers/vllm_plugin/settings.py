"""The plugin's settings: `ENGINE_REGISTRY_*` variables, one pydantic-settings class.

Read in every vLLM process the plugin is active in (`PluginSettings.from_env()`); a bad or
missing value stops the start with `PluginConfigError`, naming the variable, the value and
what is expected. A new setting is a new field (docs/configuration.md lists them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from registry_client.models import TTL_S_DEFAULT, TTL_S_MAX, TTL_S_MIN, Role
from registry_client.tls import VARS_OF_PLUGIN, ClientTLS
from workers.config import describe, read_token_file
from workers.vllm_plugin.activation import ENV_URL as ENV_URL

ENV_PREFIX = "ENGINE_REGISTRY_"
ENV_GROUP = "ENGINE_REGISTRY_GROUP"
ENV_TOKEN = "ENGINE_REGISTRY_TOKEN"
ENV_TOKEN_FILE = "ENGINE_REGISTRY_TOKEN_FILE"
ENV_ROLE = "ENGINE_REGISTRY_ROLE"
ENV_LAUNCH = "ENGINE_REGISTRY_LAUNCH_ID"

ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


class PluginConfigError(RuntimeError):
    """The plugin is active but its environment is incomplete or wrong."""


class PluginSettings(BaseSettings):
    """Every `ENGINE_REGISTRY_*` variable the plugin reads, checked."""

    _tls: ClientTLS = PrivateAttr(default_factory=ClientTLS)

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", env_ignore_empty=True, frozen=True
    )

    url: str = Field(
        "", description="registry URL(s), comma-separated replicas (setting it activates)"
    )
    group: str = Field("", description="the TP group id (required when the plugin is active)")
    token: str | None = Field(None, description="a bearer token with the worker role")
    token_file: Path | None = Field(
        None, description="a file whose first line is the token (read when no token is set)"
    )
    role: Role | None = Field(None, description="prefill, decode or both")
    ttl_s: int = Field(
        TTL_S_DEFAULT,
        ge=TTL_S_MIN,
        le=TTL_S_MAX,
        description=f"the agent lease: whole seconds, {TTL_S_MIN}-{TTL_S_MAX}",
    )
    timeout_s: float = Field(
        30.0, gt=0, le=3600, description="each registry call's deadline at start: seconds > 0"
    )
    refuse_exit_s: float = Field(
        10.0, ge=0, le=3600, description="seconds a refusing worker waits before it exits, >= 0"
    )
    kv_wait_warn_s: float = Field(
        10.0, gt=0, le=3600, description="a decode worker logs a KV pull waiting this long: s"
    )
    check_remote: bool = Field(
        True, description="a decode handshake asks the registry first (false: vLLM alone)"
    )
    handshake: Literal["registry", "side-channel"] = Field(
        "registry",
        description="registry: decode loads prefill ranks from the registry; side-channel: "
        "vLLM's ZMQ side channel",
    )
    publish: Literal["node", "rank"] = Field(
        "node",
        description="node: a node's first rank registers and renews the node's agents in one "
        "request; rank: each rank its own",
    )
    nixl_progress_us: int = Field(
        1000,
        ge=0,
        le=1_000_000,
        description="NIXL progress thread: wait for events up to this many us (0: busy poll)",
    )
    advertise_url: str = Field(
        "", description="the URL routers reach this instance's API at (default: from --port)"
    )
    launch_id: str = Field(
        "", description="the launch's id; made up by its first process when unset"
    )
    grpc_metrics_port: int | None = Field(
        None, ge=1, le=65535, description="/metrics of a gRPC-served instance on this port"
    )
    ca: Path | None = Field(
        None, description="PEM CA bundle for https:// URLs (default: the system trust store)"
    )
    cert: Path | None = Field(None, description="PEM client certificate (mutual TLS)")
    key: Path | None = Field(None, description="PEM key of the client certificate")

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() not in ROLES:
            raise ValueError("not a role")
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _complete(self) -> PluginSettings:
        if self.url.strip() and not self.group.strip():
            raise ValueError(
                f"{ENV_URL} is set ({self.url}) but {ENV_GROUP} is not; name the TP group "
                f"this instance serves (or unset {ENV_URL})"
            )
        if self.token is None and self.token_file is not None:
            token = read_token_file(self.token_file, ENV_TOKEN_FILE)
            object.__setattr__(self, "token", token)
        self._tls = ClientTLS(self.ca, self.cert, self.key, *VARS_OF_PLUGIN)
        return self

    @property
    def tls(self) -> ClientTLS:
        """HTTPS to the registry: ``ENGINE_REGISTRY_CA``, ``_CERT``, ``_KEY``."""
        return self._tls

    @property
    def urls(self) -> str:
        return self.url.strip()

    @classmethod
    def from_env(cls) -> PluginSettings:
        try:
            return cls()
        except ValidationError as exc:
            raise PluginConfigError(f"engine-registry plugin: {describe(exc, cls)}") from None
