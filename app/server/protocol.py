"""The connection's protocol: uvicorn's httptools protocol with the limits a control plane on a
shared network needs.

uvicorn (httptools) has no timeout for a request's headers and no bound on their size, and
it starts its keep-alive timer only after a first response: a connection that never sends a
byte, or trickles a header forever, holds a descriptor and memory for good. The protocol
adds, per connection:

- ``header_timeout_s``: the headers of each request must arrive within this many seconds of
  the connection opening or of the request's first byte, else ``408`` and the connection
  closes (slowloris, idle connections that never send);
- ``max_header_bytes``: a request whose headers exceed this answers ``431`` and closes;
- a request body must arrive within ``body_timeout_s`` of its headers (``408``, and the
  connection closes);
- ``max_connections`` bounds open connections: past it the connection idle the longest is
  closed to make room (``503`` when every one is busy);
- a malformed request gets a problem+json ``400`` (uvicorn's own is plain text);
- at shutdown, a request whose body has not all arrived answers ``503 shutting_down``.

One watchdog timer per connection keeps all these deadlines (no timer per request). With the
request bypass on (`app.server.bypass`), its wire path is a base of the class (`WireProtocol`).
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.core.problems import PROBLEM_MEDIA_TYPE
from app.watch.stream import TRANSPORT


def _problem_bytes(status: int, reason: str, code: str, detail: str) -> bytes:
    body = json.dumps(
        {
            "type": f"urn:engine-registry:problem:{code}",
            "title": reason,
            "status": status,
            "detail": detail,
            "code": code,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {PROBLEM_MEDIA_TYPE}\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Unbypassed(HttpToolsProtocol):
    """The protocol's hooks for the request bypass, when it is off: every request is uvicorn's."""

    _hot: object = None

    def _hot_begin(self) -> bool:
        return False

    def _hot_body(self, body: bytes) -> bool:
        return False

    def _hot_complete(self) -> bool:
        return False

    def _hot_lost(self) -> None:
        return None


class GuardedProtocol(_Unbypassed):
    """The limits (see the module); their values are a subclass's (``guarded_protocol``)."""

    header_timeout_s: ClassVar[float]
    max_header_bytes: ClassVar[int]
    max_connections: ClassVar[int]
    body_timeout_s: ClassVar[float]
    # One watchdog timer a connection checks its deadlines (head, body, keep-alive), re-armed
    # at most ``period`` apart (no longer than either timeout, so those are met exactly; a
    # keep-alive close may come up to ``period`` late): a request costs no timer of its own.
    period: ClassVar[float]
    _watch: asyncio.TimerHandle | None = None
    _active = 0.0  # when the connection last opened or finished an answer
    _header_bytes = 0  # bytes of unfinished heads received
    _head_bytes = 0  # the current head's URL and header fields
    _in_headers = True
    _head_since = 0.0  # when the current head began (or the connection opened)
    _in_body = False
    _body_since = 0.0  # when the current request's headers completed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._active = self._head_since = now = self.loop.time()
        self._watch = self.loop.call_at(now + self.period, self._tick)
        if len(self.connections) > self.max_connections:
            self._make_room()

    def _tick(self) -> None:
        self._watch = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._in_headers:
            due = self._head_since + self.header_timeout_s
            if due <= now:
                if self._idle():
                    self._refuse(
                        408,
                        "Request Timeout",
                        "request_timeout",
                        f"The request's headers did not arrive within {self.header_timeout_s:g} s.",
                    )
                    return
                due = now + self.period  # pipelined behind an answer still being made
        elif self._in_body:
            due = self._body_since + self.body_timeout_s
            if due <= now:
                self._body_too_slow()
                return
        elif self._idle() and not self.pipeline:
            due = self._active + self.timeout_keep_alive
            if due <= now:
                self.transport.close()
                return
        else:
            due = now + self.period  # the app is answering: nothing of the client's to time
        self._watch = self.loop.call_at(min(due, now + self.period), self._tick)

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _make_room(self) -> None:
        """At the limit: close the connection idle the longest (as nginx drains idle
        keep-alive connections), or refuse this one when every other is busy."""
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedProtocol) and c._idle()
        ]
        if idle:
            oldest = min(idle, key=lambda c: c._active)
            oldest._disarm()
            oldest.transport.close()
            return
        self._refuse(
            503,
            "Service Unavailable",
            "too_many_connections",
            f"The registry holds {self.max_connections} busy connections "
            "(REGISTRY_MAX_CONNECTIONS); retry shortly.",
        )

    def _disarm(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def handle_websocket_upgrade(self) -> None:
        # The connection is the WebSocket protocol's from here (a keep-alive stream has
        # its own idle timer): this watchdog would close it at the keep-alive timeout.
        self._disarm()
        super().handle_websocket_upgrade()

    def _refuse(self, status: int, reason: str, code: str, detail: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_problem_bytes(status, reason, code, detail))
            self.transport.close()

    def on_message_begin(self) -> None:
        # A new request's first byte: its head is now being read, against the clock.
        self._in_headers = True
        self._head_since = self.loop.time()
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def data_received(self, data: bytes) -> None:
        if not self._in_headers:
            super().data_received(data)
            return
        super().data_received(data)
        if self._in_headers and not self.transport.is_closing():
            # The whole chunk belongs to an unfinished head, which the parser buffers:
            # stop reading it once it is past the limit.
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._too_large()

    def _too_large(self) -> None:
        self._refuse(
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            f"The request's headers exceed {self.max_header_bytes} bytes.",
        )

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        if self._head_bytes > self.max_header_bytes:
            self._too_large()
            return
        if self._hot_begin():  # a hot route's, answered by the bypass (WireProtocol)
            self._in_body = True
            self._body_since = self.loop.time()
            return
        super().on_headers_complete()
        # A watch stream cuts off a consumer that stopped reading (app/watch/stream.py).
        self.scope.setdefault("extensions", {})[TRANSPORT] = self.transport  # type: ignore[assignment]
        # Until the message completes, its body is on the clock (a request without a
        # body completes in this same feed).
        self._in_body = True
        self._body_since = self.loop.time()

    def shutdown(self) -> None:
        # SIGTERM: a request whose body has not all arrived is answered 503 now (nothing of
        # it ran: the client retries), not left to the body timer, past uvicorn's graceful
        # timeout, which cancels it as a 500.
        cycle = self.cycle
        waiting = self._hot is not None or (cycle is not None and not cycle.response_started)
        if self._in_body and waiting and not self.pipeline:
            self._refuse(
                503,
                "Service Unavailable",
                "shutting_down",
                "This replica is shutting down: send the request again (another replica, "
                "or this one once restarted).",
            )
            return
        super().shutdown()

    def _body_too_slow(self) -> None:
        cycle = self.cycle
        if self._hot is not None or (cycle is not None and not cycle.response_started):
            self._refuse(
                408,
                "Request Timeout",
                "request_timeout",
                f"The request body did not arrive within {self.body_timeout_s:g} s "
                "(REGISTRY_BODY_TIMEOUT_S).",
            )
        elif not self.transport.is_closing():
            self.transport.close()

    # After a refusal mid-chunk the parser goes on: there is no request cycle to feed.
    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing() and not self._hot_body(body):
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if not self.transport.is_closing() and not self._hot_complete():
            super().on_message_complete()

    def on_response_complete(self) -> None:
        # uvicorn's, but for its keep-alive timer: the watchdog closes idle connections.
        self._active = self.loop.time()
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._hot_lost()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "Bad Request", "bad_http_request", f"Malformed HTTP request: {msg}")


def guarded_protocol(
    header_timeout_s: float,
    max_header_bytes: int,
    max_connections: int,
    body_timeout_s: float,
    *,
    bypass: bool = True,
) -> type[HttpToolsProtocol]:
    """The protocol class with these limits; with ``bypass``, the wire path's hooks
    (`WireProtocol`'s) before the guards' defaults (`_Unbypassed`'s)."""
    limits = {
        "header_timeout_s": header_timeout_s,
        "max_header_bytes": max_header_bytes,
        "max_connections": max_connections,
        "body_timeout_s": body_timeout_s,
        "period": min(header_timeout_s, body_timeout_s),
    }
    if not bypass:
        return type("GuardedProtocol", (GuardedProtocol,), limits)
    from app.server.bypass.wire import WireProtocol

    return type("BypassingProtocol", (WireProtocol, GuardedProtocol), limits)
