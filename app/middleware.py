"""Raw ASGI middleware: request ids, access logs and metrics; the request body limit."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import RequestTimeout
from app.metrics import Metrics
from app.problems import send_problem

log = logging.getLogger("app.access")

TOO_LARGE = "body_too_large"

# Request ids: 16 random hex digits per process, then a counter (32 hex digits, like a
# uuid4's hex). uuid4 reads os.urandom on every request, a visible share of a request's CPU.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class ObserveMiddleware:
    """Gives each request an id (``X-Request-ID``, kept when the client sends a sane one),
    logs one line per request and counts it by route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics, access_log: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        # Kept only when it is printable ASCII: anything else would come back altered.
        sane = 0 < len(given) <= 64 and given.isascii() and given.isprintable()
        request_id = given if sane else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            method = scope["method"]
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template, method).observe(elapsed)
            if self.access_log:
                client = scope.get("client")
                log.info(
                    "request",
                    extra={
                        "request_id": request_id,
                        "method": method,
                        "path": scope["path"],
                        "route": template,
                        "status": status,
                        "ms": round(elapsed * 1000, 2),
                        "client": client[0] if client else None,
                    },
                )


class BodyLimitMiddleware:
    """Reads the body (as JSON) up to ``limit`` bytes. Past it, hands the app an empty body
    and marks the request, so that path and query errors still answer 422 first and the
    validation handler answers 413 instead of "body missing" (the contract's order)."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in {"GET", "HEAD"}:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = False
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            too_large = True
        chunks: list[bytes] = []
        size = 0
        if not too_large:
            try:
                async with asyncio.timeout(self.timeout_s):
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return
                        chunk = message.get("body", b"")
                        size += len(chunk)
                        if size > self.limit:
                            too_large = True
                            break
                        chunks.append(chunk)
                        if not message.get("more_body", False):
                            break
            except TimeoutError:
                slow = RequestTimeout(
                    f"The request body did not arrive within {self.timeout_s:g} s "
                    f"({size} bytes came; REGISTRY_BODY_TIMEOUT_S)."
                )
                await send_problem(send, slow, scope, extra_headers=[(b"connection", b"close")])
                return
        body = b"" if too_large else b"".join(chunks)
        if too_large:
            scope.setdefault("state", {})[TOO_LARGE] = True
        # This API takes nothing but JSON bodies, so a body is read as JSON whatever its
        # declared type (``curl -d`` declares a form).
        scope["headers"] = [
            (k, v) for k, v in scope["headers"] if k not in {b"content-length", b"content-type"}
        ] + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
