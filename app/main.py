"""Builds the FastAPI app: routers, error handlers, middleware, and a lifespan that owns the
store. Nothing is built at import time."""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.api.routes import engines, health, instances, keepalive, mooncake, status_page, tp_groups
from app.core.errors import (
    HttpProblem,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RegistryError,
    at_edge,
)
from app.core.gcfreeze import Freezer
from app.core.metrics import Metrics
from app.core.problems import field_errors, problem_response
from app.registry import Registry
from app.security.auth import AuthMiddleware
from app.security.tokens import router as admin_router
from app.server import bypass
from app.server.bypass.fastpath import FastPath
from app.server.jsonbody import JsonLimitError
from app.server.middleware import TOO_LARGE, BodyLimitMiddleware, ObserveMiddleware
from app.server.settings import Settings
from app.store import Store, Unavailable, create_store
from app.watch.feed import Feed
from app.watch.stream import Watchers

log = logging.getLogger("app")


def watch_limit(settings: Settings) -> int:
    """``watch_max``, else half the connections the descriptor limit leaves room for."""
    if settings.watch_max is not None:
        return settings.watch_max
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(settings.max_connections, soft - 64) // 2)


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    tokens = settings.token_source()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store or create_store(
            settings.store,
            timeout_s=settings.store_timeout_s,
            sweep_interval_s=settings.sweep_interval_s,
            etcd=settings.etcd_access(),
        )
        try:
            await owned.start()
        except Exception as exc:
            log.error("cannot start: %s", exc, extra={"store": owned.description})
            raise
        # What the store loaded (every entry and lease of the file) lives as long as the
        # process: out of the collector's sight, a full collection never walks it again.
        gc.freeze()
        app.state.registry = registry = Registry(owned, metrics, settings.events_keep)
        feed = Feed(
            owned,
            registry.decoded,
            keep=settings.watch_history,
            keep_bytes=settings.watch_history_bytes,
            progress_s=min(1.0, settings.watch_bookmark_s),
        )
        feed.start()
        registry.seen = feed  # heartbeats on etcd, the status page and /metrics read from it
        app.state.watchers = Watchers(
            feed,
            metrics,
            max_watchers=watch_limit(settings),
            budget_bytes=settings.watch_send_budget_bytes,
            bookmark_s=settings.watch_bookmark_s,
        )
        log.info("registry serving", extra={"store": owned.description})
        try:
            async with tokens.watching(), Freezer().active():
                yield
        finally:
            await app.state.watchers.close()
            await feed.close()
            await registry.events.close()
            await owned.close()

    app = FastAPI(
        title="Engine registry",
        version="0.1.0",
        summary="One engine_id per launch of a TP group, and its ranks' NIXL agents.",
        lifespan=lifespan,
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
    app.router.routes.append(keepalive.route)  # GET /keepalive: a WebSocket (renewals)
    app.state.keepalive = keepalive.KeepAliveLimits(
        settings.keepalive_max, settings.keepalive_idle_s
    )
    app.state.tokens = tokens
    app.state.store_timeout_s = settings.store_timeout_s

    @app.exception_handler(RegistryError)
    async def on_registry_error(request: Request, exc: RegistryError) -> Response:
        return problem_response(exc, request.scope)

    @app.exception_handler(Unavailable)
    async def on_store_unavailable(request: Request, exc: Unavailable) -> Response:
        return problem_response(at_edge(exc), request.scope)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = field_errors(list(exc.errors()))
        if request.scope.get("state", {}).get(TOO_LARGE):
            outside_body = [e for e in errors if not e["loc"] or e["loc"][0] != "body"]
            if not outside_body:
                return problem_response(
                    PayloadTooLarge(
                        f"The request body is larger than {settings.max_body_bytes} bytes "
                        "(REGISTRY_MAX_BODY_BYTES). Agent metadata blobs must fit in it."
                    ),
                    request.scope,
                )
            errors = outside_body
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:5])
        return problem_response(
            InvalidRequest(f"The request is invalid: {where}", errors=errors), request.scope
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error: RegistryError = NotFound(f"No such path: {request.url.path}")
        elif exc.status_code == 400:
            # FastAPI answers 400 when parsing the body fails with anything but a
            # JSONDecodeError (an integer of more than 4300 digits, say); the contract: 422.
            cause = exc.__cause__
            why = str(cause or exc.detail)
            if isinstance(cause, JsonLimitError):
                where = ".".join(map(str, cause.loc))
                error = InvalidRequest(
                    f"The request body breaks a JSON limit at {where}: {why}",
                    errors=[{"loc": cause.loc, "msg": why, "type": "json_limit"}],
                )
            else:
                error = InvalidRequest(
                    f"The request body cannot be parsed as JSON: {why}",
                    errors=[{"loc": ["body"], "msg": why, "type": "json_invalid"}],
                )
        else:
            code = {405: "method_not_allowed"}.get(exc.status_code, "http_error")
            error = HttpProblem(exc.status_code, code, str(exc.detail))
        return problem_response(error, request.scope, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", extra={"path": request.url.path})
        return problem_response(
            HttpProblem(500, "internal", "The registry failed unexpectedly; see its log."),
            request.scope,
        )

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
