"""Configuration: one pydantic-settings class, every field a ``REGISTRY_`` variable and a flag."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.security.auth import Tokens
from app.store import EtcdAccess, check_store_url

if TYPE_CHECKING:  # app.security.tokens imports FastAPI, which the CLI's other commands do not need
    from app.security.tokens import TokenSource


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REGISTRY_", extra="ignore")
    _token_source: TokenSource | None = PrivateAttr(default=None)

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on (0: any free).")
    store: str = Field(
        "sqlite:///registry.db",
        description="sqlite:///path/to/registry.db or etcd[s]://host:port[,host:port…]/prefix",
    )
    tokens_file: Path | None = Field(None, description="File of role:token lines.")
    tokens: str | None = Field(
        None, description="role:token pairs separated by commas (with the file's, if any)."
    )
    insecure: bool = Field(False, description="Serve without tokens on a non-loopback address.")
    store_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Bound on every store call; past it, 503."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Request body limit.")
    sweep_interval_s: float = Field(
        1.0, gt=0, le=60, description="How often expired leases are purged (SQLite)."
    )
    keep_alive_s: int = Field(
        75, ge=1, le=3600, description="Idle keep-alive connections close after this."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="A request's headers must arrive within this (408)."
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=600, description="A request's body must arrive within this (408)."
    )
    max_header_bytes: int = Field(
        65536, ge=4096, le=1048576, description="Largest request head accepted (431)."
    )
    max_connections: int = Field(
        8192, ge=16, description="Open connections; past it the idlest is closed."
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")
    access_log: bool = Field(True, description="One log line per request.")
    access_log_rate: int = Field(
        100,
        ge=0,
        description="Most access lines a second for answered requests (errors always; 0: all).",
    )
    events_keep: int = Field(
        1000,
        ge=10,
        le=100_000,
        description="Events (refusals, handshakes, lease expiries) the store keeps, newest first.",
    )
    watch_history: int = Field(
        10_000,
        ge=10,
        le=1_000_000,
        description="Group changes each replica keeps for watches and list pages; older: 410.",
    )
    watch_history_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="The memory (estimated) those changes may hold; past it the oldest go "
        "first (watchers behind them get 410).",
    )
    watch_max: int | None = Field(
        None,
        ge=1,
        description="Watch streams per replica, below max_connections (default: half the "
        "connection limit, itself kept below the descriptor limit); past it, 503 "
        "too_many_watchers.",
    )
    watch_bookmark_s: float = Field(
        5.0, gt=0, le=300, description="A quiet watch stream gets a BOOKMARK this often."
    )
    watch_send_budget_bytes: int = Field(
        8 * 1024 * 1024,
        ge=65536,
        description="Bytes a watcher may fall behind; past it, closed (slow_consumer).",
    )
    fast_path: bool = Field(
        True, description="Answer the hot routes without FastAPI's per-request machinery."
    )
    # Overload (docs/operations.md, "Overload"): app/server/shedding.py, app/store/lease_clock.py.
    shed_lag_s: float = Field(
        0.2,
        ge=0,
        description="Shed the sheddable routes while the event loop lags more than this (0: "
        "never on lag).",
    )
    shed_in_flight: int = Field(
        2,
        ge=0,
        description="The sheddable routes' GETs answered at once; more wait for a seat (0: no "
        "cap).",
    )
    shed_queue_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="How long a sheddable GET waits for a seat before it is shed (0: shed at "
        "once).",
    )
    shed_retry_after_s: int = Field(
        2, ge=1, le=300, description="Retry-After of a shed request's 503 overloaded, seconds."
    )
    shed_routes: str = Field(
        "/status,/events,/metrics,/tp-groups,/instances",
        description="Paths whose GETs are shed under saturation, comma separated (empty: none).",
    )
    keepalive_max: int = Field(
        4096,
        ge=0,
        description="Keep-alive streams (GET /keepalive) per replica; past it, 503 overloaded "
        "(the node renews over REST); 0: the route answers 404.",
    )
    keepalive_idle_s: float = Field(
        3600.0,
        gt=0,
        le=86400,
        description="A keep-alive stream with no renewal for this long is closed.",
    )
    keepalive_ping_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description="A keep-alive stream quiet this long is pinged; no pong within as long "
        "closes it (a renewing stream is not pinged).",
    )
    lease_grace_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="Most a lease's expiry moves for the registry's own stalls and restarts "
        "since its last renewal (0: no grace); etcd keeps a lease this long past its ttl.",
    )
    loop_stall_s: float = Field(
        1.0, gt=0, le=60, description="A gap in the event loop longer than this is a stall."
    )
    etcd_renew_window_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="etcd store: a lease's etcd TTL runs this long past ttl + grace, so most "
        "renewals stay in memory, shared by a journal (0: every renewal reaches etcd).",
    )
    blob_codec: Literal["deflate", "none"] = Field(
        "deflate",
        description="How agents' metadata blobs are stored: deflate (zlib, when it saves an "
        "eighth or more) or none (as sent); either way served as sent, and both read.",
    )
    otel: bool = Field(
        False,
        description="FastAPI's own OpenTelemetry spans and metrics, for a process with an "
        "OpenTelemetry SDK set up (opentelemetry-instrument); off: never checked per request.",
    )
    # The etcd store over TLS with credentials (etcds://); checked in app/store/etcd/config.py.
    etcd_ca: Path | None = Field(
        None, description="etcds:// store: CA that signed etcd's certificate (else system CAs)."
    )
    etcd_cert: Path | None = Field(
        None, description="etcds:// store: client certificate, for etcd's --client-cert-auth."
    )
    etcd_key: Path | None = Field(None, description="etcds:// store: the client certificate's key.")
    etcd_user: str | None = Field(None, description="etcds:// store: etcd user (etcd auth).")
    etcd_password_file: Path | None = Field(
        None, description="etcds:// store: file holding the etcd user's password."
    )
    etcd_password: SecretStr | None = Field(
        None, description="etcds:// store: the etcd user's password (prefer the file)."
    )
    # Transport security (docs/security.md): HTTPS, and mutual TLS with a client CA.
    tls_cert: Path | None = Field(
        None, description="PEM certificate chain; with --tls-key the registry serves HTTPS only."
    )
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert.")
    tls_client_ca: Path | None = Field(
        None,
        description="PEM CA bundle: clients must present a certificate it signed (mutual TLS).",
    )

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        return check_store_url(value)

    @model_validator(mode="after")
    def _etcd_access_fits_store(self) -> Settings:
        self.etcd_access().check(self.store)
        return self

    def etcd_access(self) -> EtcdAccess:
        password = self.etcd_password.get_secret_value() if self.etcd_password else None
        return EtcdAccess(
            ca=self.etcd_ca,
            cert=self.etcd_cert,
            key=self.etcd_key,
            user=self.etcd_user,
            password=password,
            password_file=self.etcd_password_file,
        )

    @model_validator(mode="after")
    def _watches_leave_room_for_requests(self) -> Settings:
        if self.watch_max is not None and self.watch_max >= self.max_connections:
            raise ValueError(
                f"--watch-max {self.watch_max} (REGISTRY_WATCH_MAX) must be below "
                f"--max-connections {self.max_connections}: each watch holds a connection, and "
                "requests need some"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "HTTPS needs both --tls-cert and --tls-key (REGISTRY_TLS_CERT, REGISTRY_TLS_KEY); "
                "only one was given"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-client-ca (REGISTRY_TLS_CLIENT_CA) needs HTTPS: give --tls-cert and "
                "--tls-key too"
            )
        return self

    @model_validator(mode="after")
    def _refuse_open_network(self) -> Settings:
        if not self.auth_tokens() and not self.insecure and not is_loopback_host(self.host):
            raise ValueError(
                f"Refusing to listen on {self.host} without tokens: anyone who reaches it could "
                "replace agents' metadata. Give tokens with --tokens-file (REGISTRY_TOKENS_FILE) "
                "or --tokens, or listen on 127.0.0.1, or pass --insecure (REGISTRY_INSECURE=1) "
                "on a trusted network."
            )
        return self

    def token_source(self) -> TokenSource:
        """The tokens file and ``REGISTRY_TOKENS``, read once: the open-network check above
        reads them, and the service serves with that same source (reloads included)."""
        if self._token_source is None:
            from app.security.tokens import TokenSource

            self._token_source = TokenSource(self.tokens_file, self.tokens)
        return self._token_source

    def auth_tokens(self) -> Tokens:
        return self.token_source().tokens
