"""The hot routes answered in front of every ASGI layer, in one write.

``FastPath`` (app/server/bypass/fastpath.py) answers the hot routes inside FastAPI's stack: each
request
still passes uvicorn's proxy-headers layer, FastAPI's and Starlette's outer middleware, the
request-id/metrics layer and the auth layer, each wrapping ``send``; and uvicorn's ``send``
writes the status line and headers, then the body, as two writes (two syscalls, two packets
the client reads apart). In the launch storm that was about a fifth of the event loop's time
per request (``docs/benchmarks.md``).

This app is the one uvicorn calls. For a hot route (``FastPath.match``) whose request needs
nothing the outer layers do (no query string, no ``X-Forwarded-*`` header, credentials that
pass), it runs the same pieces in one frame: the request id and metrics of
:class:`~app.server.middleware.ObserveMiddleware`, the check of
:class:`~app.security.auth.AuthMiddleware`,
the handler of :class:`~app.server.bypass.fastpath.FastPath`, and writes the answer (uvicorn's
default
headers, the same headers in the same order) in one write on uvicorn's connection. Anything
else, including every refusal by auth and every request the fast path would hand to FastAPI,
goes on to the full stack untouched, which answers it as before. The pieces are the very
instances FastAPI's stack holds (one access-log budget, one set of counters).
``REGISTRY_FAST_PATH=false`` turns this off with the fast path.

Most hot requests do not even reach this app as ASGI: the connection's protocol
(app/server/bypass/wire.py) takes them before uvicorn builds a request of them, and calls ``take``,
``answer``, ``wire`` and ``finish`` here itself. This app answers the rest (a request
pipelined behind another, one that arrived while the client was not reading its answers).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from app.core.errors import HttpProblem, RegistryError, at_edge
from app.core.problems import problem_answer
from app.security.auth import AuthMiddleware, acting, required_role
from app.server.bypass.fastpath import (
    Fallback,
    FastPath,
    Handler,
    encoded,
    over_limit,
    path_parts,
    read_body,
    replayed,
)
from app.server.middleware import ObserveMiddleware, arrived, is_heartbeat, request_id_of
from app.store import Unavailable
from app.store.lease_clock import ARRIVED, IN_FLIGHT

log = logging.getLogger("app")

_JSON = (b"content-type", b"application/json")
_FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host")
_Parts = tuple[ObserveMiddleware, AuthMiddleware, FastPath]
# A hot route's handler, its route (for the metrics' template) and the path's segments.
Taken = tuple[Handler, BaseRoute, list[str]]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


class HotPath:
    def __init__(self, inner: ASGIApp, app: FastAPI) -> None:
        self.inner = inner  # what uvicorn would call: its proxy-headers layer, then FastAPI
        self.app = app
        self._parts: _Parts | None = None
        self._looked = False
        self._defaults: list[tuple[bytes, bytes]] | None = None
        self._defaults_bytes = b""

    def parts(self) -> _Parts | None:
        """Observe -> Auth -> FastPath, adjacent in FastAPI's built stack (None if not: the
        hot path then stays off rather than skip a layer it does not know)."""
        if self._looked:
            return self._parts
        layer: Any = self.app.middleware_stack
        for _ in range(32):
            if layer is None or isinstance(layer, ObserveMiddleware):
                break
            layer = getattr(layer, "app", None)
        if layer is None:
            return None  # not built yet (no lifespan ran): look again next time
        self._looked = True
        auth = getattr(layer, "app", None)
        fast = getattr(auth, "app", None)
        if isinstance(auth, AuthMiddleware) and isinstance(fast, FastPath):
            self._parts = (layer, auth, fast)
        return self._parts

    def take(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], scope: Scope
    ) -> Taken | None:
        """The hot route a request is for, when nothing the outer layers do is needed and its
        credentials pass (None: the full stack answers it). No query string: the caller's."""
        if (parts := self.parts()) is None:
            return None
        _, auth, fast = parts
        segments = path_parts(path)
        entry = None if segments is None else fast.match(method, segments)
        if (
            entry is None
            or segments is None
            or any(name in _FORWARDED for name, _ in headers)
            or over_limit(scope, fast.limit)
        ):
            return None
        tokens = auth.source.tokens
        if tokens:
            needed = required_role(method, path)
            if needed is not None and auth.verdict(scope, tokens, needed) is not None:
                return None  # the full stack answers it: 401/403
        return entry[0], entry[1], segments

    @property
    def limit(self) -> int:
        parts = self.parts()
        return 0 if parts is None else parts[2].limit

    async def answer(self, scope: Scope, taken: Taken, raw: bytes | None) -> Answer | None:
        """The hot route's answer (status, headers, body), None when the full stack must
        answer it (``Fallback``: the request is not the fast path's to answer)."""
        handler, route, segments = taken
        scope["app"] = self.app
        at = scope.get("arrived")  # in this request's task: its renewals are judged at it
        if at is None:
            arrived(scope)
        else:
            ARRIVED.set(at)
        request_id = request_id_of(scope)
        acting(scope)  # in this request's task: the events it causes name its token
        try:
            result = await handler(scope, segments, raw)
        except Fallback:
            return None
        except Exception as exc:
            if not isinstance(exc, RegistryError | Unavailable):
                log.exception("unhandled error", extra={"path": scope["path"]})
                exc = HttpProblem(500, "internal", "The registry failed unexpectedly; see its log.")
            scope["route"] = route
            rid = [(b"x-request-id", request_id.encode())]
            return problem_answer(at_edge(exc), scope, rid)
        if result is None:
            return None
        scope["route"] = route
        status, body = encoded(result)
        # The headers FastAPI's JSONResponse and the request-id layer send, in their order.
        headers: list[tuple[bytes, bytes]] = [
            (b"content-length", b"%d" % len(body)),
            _JSON,
            (b"x-request-id", request_id.encode()),
        ]
        return status, headers, body

    def finish(self, scope: Scope, status: int, started: float) -> None:
        """Count and log the answered request (``ObserveMiddleware``'s own bookkeeping)."""
        parts = self.parts()
        if parts is not None:
            parts[0].finish(scope, scope["state"]["request_id"], status, started)

    def wire(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        defaults: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> bytes:
        """The whole answer as uvicorn's ``send`` would write it: its default headers (date,
        server) first, then the answer's, then ``connection: close`` when not kept alive."""
        if defaults is not self._defaults:  # uvicorn renews the list (its date) every second
            self._defaults = defaults
            self._defaults_bytes = b"".join(b"%s: %s\r\n" % (n, v) for n, v in defaults)
        head = b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers)
        close = b"" if keep_alive else b"connection: close\r\n"
        return b"".join((STATUS_LINE[status], self._defaults_bytes, head, close, b"\r\n", body))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = getattr(send, "__self__", None)
        taken = (
            None
            if scope["type"] != "http"
            or scope["query_string"]
            or not isinstance(cycle, RequestResponseCycle)
            else self.take(scope["method"], scope["path"], scope["headers"], scope)
        )
        if taken is None or cycle is None:
            await self.inner(scope, receive, send)
            return
        raw: bytes | None = None
        if scope["method"] != "GET":
            raw = await read_body(receive, self.limit)
            if raw is None or len(raw) > self.limit:
                await self.inner(scope, replayed(raw, receive), send)
                return
        started = time.perf_counter()
        token = IN_FLIGHT.begin(arrived(scope)) if is_heartbeat(scope) else -1
        try:
            answer = await self.answer(scope, taken, raw)
        finally:
            IN_FLIGHT.end(token)
        if answer is None:
            await self.inner(scope, replayed(raw, receive), send)
            return
        status, headers, body = answer
        try:
            if not self._write(cycle, status, headers, body):
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
        finally:
            self.finish(scope, status, started)

    def _write(
        self,
        cycle: RequestResponseCycle,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> bool:
        """The whole answer in one write, with the state changes uvicorn's ``send`` makes;
        False (nothing done) when ``send`` must do it: writes paused, client gone."""
        if cycle.flow.write_paused or cycle.disconnected or cycle.response_started:
            return False
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(
            self.wire(status, headers, body, cycle.default_headers, cycle.keep_alive)
        )
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True
