"""The hot routes answered in front of every ASGI layer, in one write.

``FastPath`` (app/api/fastpath.py) answers the hot routes inside FastAPI's stack: each request
still passes uvicorn's proxy-headers layer, FastAPI's and Starlette's outer middleware, the
request-id/metrics layer and the auth layer, each wrapping ``send``; and uvicorn's ``send``
writes the status line and headers, then the body, as two writes (two syscalls, two packets
the client reads apart). In the launch storm that was about a fifth of the event loop's time
per request (``bench/README.md``).

This app is the one uvicorn calls. For a hot route (``FastPath.match``) whose request needs
nothing the outer layers do (no query string, no ``X-Forwarded-*`` header, credentials that
pass), it runs the same pieces in one frame: the request id and metrics of
:class:`~app.middleware.ObserveMiddleware`, the check of :class:`~app.auth.AuthMiddleware`,
the handler of :class:`~app.api.fastpath.FastPath`, and writes the answer (uvicorn's default
headers, the same headers in the same order) in one write on uvicorn's connection. Anything
else, including every refusal by auth and every request the fast path would hand to FastAPI,
goes on to the full stack untouched, which answers it as before. The pieces are the very
instances FastAPI's stack holds (one access-log budget, one set of counters).
``REGISTRY_FAST_PATH=false`` turns this off with the fast path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from app.api.fastpath import (
    Fallback,
    FastPath,
    encoded,
    over_limit,
    path_parts,
    read_body,
    replayed,
    send_json,
)
from app.auth import AuthMiddleware, required_role
from app.errors import HttpProblem, RegistryError, at_edge
from app.middleware import ObserveMiddleware, request_id_of, with_request_id
from app.problems import send_problem
from app.store import Unavailable

log = logging.getLogger("app")

_LENGTH = b"content-length: "
_JSON = b"\r\ncontent-type: application/json\r\nx-request-id: "
_FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host")
_Parts = tuple[ObserveMiddleware, AuthMiddleware, FastPath]


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = getattr(send, "__self__", None)
        if (
            scope["type"] != "http"
            or scope["query_string"]
            or not isinstance(cycle, RequestResponseCycle)
            or (parts := self.parts()) is None
        ):
            await self.inner(scope, receive, send)
            return
        observe, auth, fast = parts
        method = scope["method"]
        segments = path_parts(scope["path"])
        entry = None if segments is None else fast.match(method, segments)
        if (
            entry is None
            or segments is None
            or any(name in _FORWARDED for name, _ in scope["headers"])
            or over_limit(scope, fast.limit)
        ):
            await self.inner(scope, receive, send)
            return
        tokens = auth.source.tokens
        if tokens:
            needed = required_role(method, scope["path"])
            if needed is not None and auth.verdict(scope, tokens, needed) is not None:
                await self.inner(scope, receive, send)  # answered there: 401/403
                return
        handler, route = entry
        raw: bytes | None = None
        if method != "GET":
            raw = await read_body(receive, fast.limit)
            if raw is None or len(raw) > fast.limit:
                await self.inner(scope, replayed(raw, receive), send)
                return
        scope["app"] = self.app
        started = time.perf_counter()
        request_id = request_id_of(scope)
        try:
            answer = await handler(scope, segments, raw)
        except Fallback:
            answer = None
        except Exception as exc:
            if not isinstance(exc, RegistryError | Unavailable):
                log.exception("unhandled error", extra={"path": scope["path"]})
                exc = HttpProblem(500, "internal", "The registry failed unexpectedly; see its log.")
            scope["route"] = route
            error = at_edge(exc)
            try:
                await send_problem(with_request_id(send, request_id), error, scope)
            finally:
                observe.finish(scope, request_id, error.status, started)
            return
        if answer is None:
            await self.inner(scope, replayed(raw, receive), send)
            return
        scope["route"] = route
        status, body = encoded(answer)
        try:
            # The headers FastAPI's JSONResponse and the request-id layer send, in their order.
            head = b"%s%d%s%s\r\n" % (_LENGTH, len(body), _JSON, request_id.encode())
            if not self._write(cycle, status, head, body):
                await send_json(with_request_id(send, request_id), status, body)
        finally:
            observe.finish(scope, request_id, status, started)

    def _write(self, cycle: RequestResponseCycle, status: int, head: bytes, body: bytes) -> bool:
        """The whole answer in one write, with the state changes uvicorn's ``send`` makes;
        False (nothing done) when ``send`` must do it: writes paused, client gone."""
        if cycle.flow.write_paused or cycle.disconnected or cycle.response_started:
            return False
        defaults = cycle.default_headers
        if defaults is not self._defaults:  # uvicorn renews the list (its date) every second
            self._defaults = defaults
            self._defaults_bytes = b"".join(b"%s: %s\r\n" % (n, v) for n, v in defaults)
        close = b"" if cycle.keep_alive else b"connection: close\r\n"
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(
            b"".join((STATUS_LINE[status], self._defaults_bytes, head, close, b"\r\n", body))
        )
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True
