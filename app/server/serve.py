"""Runs the app under uvicorn with the limits a control plane on a shared network needs (the
connection's guards: `app.server.protocol`).

Idle keep-alive connections close after ``keep_alive_s`` (75 s, as nginx, give or take the
watchdog's period; uvicorn's 5 s default raced clients' pools: aiohttp keeps an idle
connection 15 s, and a request sent on a connection the server closes at that instant is
reset, which broke the 1,024- and 4,096-rank storms; it also outlives a worker's heartbeat
interval, so that connection is reused). ``max_connections`` is kept below the process's
descriptor limit, whose soft value is raised to the hard one at start.

On SIGTERM the registry drains first (`app.server.shutdown`): held ``wait_ready``s answer,
requests being answered finish, then every watch stream ends with a final ``shutting_down``
line at the store's revision; then uvicorn closes connections and the store.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket
import ssl
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from app.security.tls import server_context, tls_loop_factory
from app.server.bypass import wanted
from app.server.bypass.keepalive import FAST_MAX
from app.server.protocol import guarded_protocol
from app.server.settings import Settings, is_loopback_host
from app.server.shedding import install
from app.server.shutdown import drain
from app.server.websocket import GuardedWebSocket

log = logging.getLogger("app")

FD_RESERVE = 64  # descriptors kept for the store, logs and the listening socket


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class RegistryServer(uvicorn.Server):
    """uvicorn, with the registry's drain before its own shutdown (`app.server.shutdown`)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await drain(self, self._app.state)
        except Exception:  # uvicorn's own shutdown runs whatever happened
            log.exception("the shutdown's drain failed")
        await super().shutdown(sockets)


def _keepalive_wire() -> type:
    from app.server.bypass.keepalive_wire import KeepAliveWire

    return KeepAliveWire


def uvicorn_options(settings: Settings, *, bypass: bool | None = None) -> dict[str, Any]:
    """The server's settings, shared with the benchmarks' ceiling servers; ``bypass``: whether
    the request bypass runs (default: ``REGISTRY_FAST_PATH``, where this uvicorn allows it)."""
    if bypass is None:
        bypass = wanted(settings.fast_path)
    limit = raise_fd_limit()
    max_connections = max(16, min(settings.max_connections, limit - FD_RESERVE))
    if max_connections < settings.max_connections:
        log.warning(
            "connection limit lowered to fit the descriptor limit",
            extra={"max_connections": max_connections, "nofile": limit},
        )
    return {
        "http": guarded_protocol(
            settings.header_timeout_s,
            settings.max_header_bytes,
            max_connections,
            settings.body_timeout_s,
            bypass=bypass,
        ),
        # Keep-alive streams: renewals read in the connection's protocol with the bypass on;
        # either way one protocol whose deadlines end a stream (app/server/websocket.py).
        "ws": _keepalive_wire() if bypass else GuardedWebSocket,
        "ws_max_size": FAST_MAX,
        "ws_ping_interval": settings.keepalive_ping_s,
        "ws_ping_timeout": settings.keepalive_ping_s,
        "loop": "uvloop",
        "log_config": None,
        "access_log": False,
        "timeout_keep_alive": settings.keep_alive_s,
        "backlog": 4096,
        "timeout_graceful_shutdown": 10,
    }


class RegistryConfig(uvicorn.Config):
    """uvicorn's config serving the registry's own TLS context (``app.security.tls``) on asyncio's
    loop
    with alerting, bounded handshakes (uvloop for plain HTTP)."""

    def __init__(
        self,
        app: FastAPI,
        *,
        tls: ssl.SSLContext | None,
        handshake_timeout_s: float,
        hot_path: bool = False,
        **kw: Any,
    ) -> None:
        self._tls = tls
        self._hot_path = hot_path
        self._app = app
        self._handshake_timeout_s = handshake_timeout_s
        super().__init__(app, **kw)

    def load(self) -> None:
        super().load()
        if self._hot_path:
            from app.server.bypass.hot import HotPath

            self.loaded_app = HotPath(self.loaded_app, self._app)
        if self._tls is not None:
            self.ssl = self._tls

    def get_loop_factory(self) -> Callable[[], asyncio.AbstractEventLoop] | None:
        if self._tls is None:
            return super().get_loop_factory()
        return tls_loop_factory(self._handshake_timeout_s)


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context the settings ask for (raises ``TlsConfigError`` naming the file)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return server_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


# Python's cyclic garbage collector, tuned for a request loop (measured in docs/benchmarks.md):
# at the default threshold (700 net new container objects) a launch storm of 1,024 ranks ran
# ~70 young collections, 6 of the middle generation and now and then a full one (~60 ms with
# a large store: a pause every in-flight request waits out); with a young generation of
# 10,000 it runs 1 or 2. Cyclic garbage between collections stays a few MB at most.
GC_THRESHOLD = (10_000, 10, 10)


def serve(app: FastAPI, settings: Settings, tls: ssl.SSLContext | None = None) -> None:
    gc.set_threshold(*GC_THRESHOLD)
    install(app, settings)  # lease clock and shedding (app/server/shedding.py)
    bypass = wanted(settings.fast_path)
    options = uvicorn_options(settings, bypass=bypass)
    if tls is not None:
        # uvicorn marks the scope's scheme https and logs https:// from these; the context
        # it would build from them is replaced by ``tls`` in RegistryConfig.load().
        options |= {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
        log.info(
            "serving HTTPS",
            extra={"mutual_tls": settings.tls_client_ca is not None, "min_version": "TLSv1.2"},
        )
    elif not is_loopback_host(settings.host):
        log.warning(
            f"serving plain HTTP on {settings.host}: bearer tokens and every rank's NIXL agent "
            "metadata cross the network in clear text, and anyone on the path can read a "
            "worker token and then register agents or open engines. Serve HTTPS with "
            "--tls-cert and --tls-key (REGISTRY_TLS_CERT, REGISTRY_TLS_KEY); see "
            "docs/security.md",
            extra={"risk": "cleartext_tokens"},
        )
    config = RegistryConfig(
        app,
        tls=tls,
        handshake_timeout_s=settings.header_timeout_s,
        hot_path=bypass,
        host=settings.host,
        port=settings.port,
        **options,
    )
    RegistryServer(config, app).run()
