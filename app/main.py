"""Builds the FastAPI app: routers, error handlers (``app.api.handlers``), middleware, and a
lifespan that owns the store (``app.api.lifespan``). Nothing is built at import time."""

from __future__ import annotations

from fastapi import FastAPI

from app.api.handlers import exception_handlers
from app.api.lifespan import lifespan
from app.api.routes import engines, health, instances, keepalive, mooncake, status_page, tp_groups
from app.core.metrics import Metrics
from app.security.auth import AuthMiddleware
from app.security.tokens import router as admin_router
from app.server import bypass
from app.server.bypass.fastpath import FastPath
from app.server.middleware import BodyLimitMiddleware, ObserveMiddleware
from app.server.settings import Settings
from app.store import Store


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    tokens = settings.token_source()
    app = FastAPI(
        title="Engine registry",
        version="0.1.0",
        summary="One engine_id per launch of a TP group, and its ranks' NIXL agents.",
        lifespan=lifespan(settings, metrics, tokens, store),
        exception_handlers=exception_handlers(settings.max_body_bytes),
        strict_content_type=False,
        # FastAPI looks for OpenTelemetry providers at every request unless told not to.
        telemetry=None if settings.otel else {"tracing": False, "metrics": False, "logs": False},
    )
    app.include_router(tp_groups.router)
    app.include_router(engines.router)
    app.include_router(mooncake.router)
    app.include_router(instances.router)
    app.include_router(health.router)
    app.include_router(status_page.router)
    app.include_router(admin_router)
    # GET /keepalive, a WebSocket (renewals), first: an upgrade is matched before FastAPI walks
    # every included router's routes for it (the only other WebSocket scope is a 404).
    app.router.routes.insert(0, keepalive.route)
    app.state.keepalive = keepalive.KeepAliveLimits(
        settings.keepalive_max, settings.keepalive_idle_s
    )
    app.state.tokens = tokens
    app.state.store_timeout_s = settings.store_timeout_s

    # Innermost first (each add wraps the ones before): the body limit in front of the router;
    # the hot routes' fast path (which reads bodies within the same limit and passes anything
    # larger on); auth before any parsing; ids and metrics around everything.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.fast_path and bypass.unavailable() is None:  # serve() logs why not
        app.add_middleware(
            FastPath,
            routes=[*tp_groups.router.routes, *engines.router.routes],
            limit=settings.max_body_bytes,
        )
    app.add_middleware(AuthMiddleware, source=tokens)
    app.add_middleware(
        ObserveMiddleware,
        metrics=metrics,
        access_log=settings.access_log,
        access_log_rate=settings.access_log_rate,
    )
    return app
