"""Raw ASGI middleware: request ids, access logs and metrics; the request body limit."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.metrics import Metrics
from app.server.shedding import shedder_of
from app.store.lease_clock import ARRIVED, IN_FLIGHT

log = logging.getLogger("app.access")

TOO_LARGE = "body_too_large"

# Request ids: 16 random hex digits per process, then a counter (32 hex digits, like a
# uuid4's hex). uuid4 reads os.urandom on every request, a visible share of a request's CPU.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class AccessLogBudget:
    """At most ``rate`` lines a second for answered requests; errors are always logged.

    One JSON line costs about as much CPU as the registry's own work for a lookup; at fleet
    scale (thousands of heartbeats a second) the log would cost more than the service. Past
    the budget, lines are counted, and the next line logged says how many were left out.
    ``rate`` 0 logs every request."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.second = 0
        self.used = 0
        self.skipped = 0

    def take(self, now: float, status: int) -> int | None:
        """None: do not log; else how many lines were skipped before this one."""
        if self.rate <= 0:
            return 0
        second = int(now)
        if second != self.second:
            self.second, self.used = second, 0
        if self.used >= self.rate and status < 400:
            self.skipped += 1
            return None
        self.used += 1
        skipped, self.skipped = self.skipped, 0
        return skipped


def arrived(scope: Scope) -> float:
    """When the request reached the registry (its head read): the instant a heartbeat's
    leases are judged at (``app/store/lease_clock.py``), set for this request's task."""
    at: float = scope.setdefault("arrived", time.monotonic())  # the lease clock
    ARRIVED.set(at)
    return at


def is_heartbeat(scope: Scope) -> bool:
    path: str = scope["path"]
    return scope["method"] == "POST" and path.endswith("/heartbeat")


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-ID`` when sane, else a new one; kept in ``scope["state"]``."""
    given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
    # Kept only when it is printable ASCII: anything else would come back altered.
    sane = 0 < len(given) <= 64 and given.isascii() and given.isprintable()
    request_id = given if sane else new_request_id()
    scope.setdefault("state", {})["request_id"] = request_id
    return request_id


def add_request_id(message: Message, request_id: str) -> None:
    """Add ``X-Request-ID`` to a response start's headers (last, as every answer has it)."""
    message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]


def with_request_id(send: Send, request_id: str) -> Send:
    """``send``, with ``X-Request-ID`` added to the response's start."""

    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            add_request_id(message, request_id)
        await send(message)

    return tagged


class ObserveMiddleware:
    """Gives each request an id (``X-Request-ID``, kept when the client sends a sane one),
    logs one line per request (within a budget, see :class:`AccessLogBudget`) and counts it
    by route template. It stamps the request's arrival (heartbeats are held in flight for the
    lease sweeper) and sheds what can wait when the registry is saturated
    (``app/server/shedding.py``)."""

    def __init__(
        self, app: ASGIApp, metrics: Metrics, access_log: bool = True, access_log_rate: int = 0
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log
        self.budget = AccessLogBudget(access_log_rate)
        # prometheus_client's labels() takes a lock and builds a key: once per label set.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._upgrade(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        at = arrived(scope)
        request_id = request_id_of(scope)
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                add_request_id(message, request_id)
            await send(message)

        shedder = shedder_of(scope)
        token = IN_FLIGHT.begin(at) if is_heartbeat(scope) else None
        try:
            if shedder is not None and shedder.sheddable(scope):
                await shedder.serve(scope, receive, send_wrapper, self.app, self.metrics)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            if token is not None:
                IN_FLIGHT.end(token)
            self.finish(scope, request_id, status, started)

    async def _upgrade(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket upgrade (``GET /keepalive``) is a request answered once: counted and
        logged as one when the app accepts it (101, the answer carrying ``X-Request-ID``) or
        refuses it (its status; a close before the accept: 403, as uvicorn answers it). The
        stream after it is not (it lasts as long as its node); uvicorn's own lines for it are
        held at debug (``app.server.websocket``)."""
        started = time.perf_counter()
        request_id = request_id_of(scope)
        answered = False

        async def send_wrapper(message: Message) -> None:
            nonlocal answered
            if not answered:
                kind = message["type"]
                status = message["status"] if kind == DENIAL else UPGRADE_ANSWERS.get(kind)
                if status is not None:
                    answered = True
                    if kind != "websocket.close":
                        add_request_id(message, request_id)
                    self.finish(scope, request_id, status, started)
            await send(message)

        await self.app(scope, receive, send_wrapper)

    def finish(self, scope: Scope, request_id: str, status: int, started: float) -> None:
        """Count the answered request by route template, and log it within the budget."""
        elapsed = time.perf_counter() - started
        route = scope.get("route")
        template = getattr(route, "path", "unmatched")
        method = scope.get("method", "GET")  # a WebSocket scope has none: its upgrade is a GET
        counter = self._counters.get((template, method, status))
        if counter is None:
            counter = self.metrics.requests.labels(template, method, str(status))
            self._counters[(template, method, status)] = counter
        counter.inc()
        timer = self._timers.get((template, method))
        if timer is None:
            timer = self._timers[(template, method)] = self.metrics.latency.labels(template, method)
        timer.observe(elapsed)
        skipped = self.budget.take(time.time(), status) if self.access_log else None
        if skipped is not None:
            client = scope.get("client")
            log.info(
                "request",
                extra={
                    "not_logged_before": skipped,
                    "request_id": request_id,
                    "method": method,
                    "path": scope["path"],
                    "route": template,
                    "status": status,
                    "ms": round(elapsed * 1000, 2),
                    "client": client[0] if client else None,
                    "user_agent": user_agent(scope),
                },
            )


# How a WebSocket upgrade is answered, by the app's first message that answers it (a denial
# response carries its own status).
UPGRADE_ANSWERS = {"websocket.accept": 101, "websocket.close": 403}
DENIAL = "websocket.http.response.start"


def user_agent(scope: Scope) -> str | None:
    """The request's ``User-Agent`` (the workers name their group, node and pid there), cut
    to 200 characters; looked for only when the request is logged."""
    for name, value in scope["headers"]:
        if name == b"user-agent":
            return bytes(value[:200]).decode("latin-1")
    return None


class BodyLimitMiddleware:
    """Reads the body (as JSON) up to ``limit`` bytes. Past it, hands the app an empty body
    and marks the request, so that path and query errors still answer 422 first and the
    validation handler answers 413 instead of "body missing" (the contract's order)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

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
            # A body that never completes is cut by the server's body timer (app/server/serve.py).
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
        body = b"" if too_large else b"".join(chunks)
        if too_large:
            scope.setdefault("state", {})[TOO_LARGE] = True
        # This API takes nothing but JSON bodies, so a body is read as JSON whatever its
        # declared type (``curl -d`` declares a form).
        scope["headers"] = [
            (k, v) for k, v in scope["headers"] if k not in {b"content-length", b"content-type"}
        ] + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await self.app(scope, replay(body, receive), send)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` (already read) once, then defers to ``receive``."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
