"""The hot routes answered in the connection's protocol, before uvicorn makes a request of them.

For each request uvicorn builds a request-response cycle (an object, an ``asyncio.Event``, the
ASGI ``receive``/``send`` pair), starts a task running the app through it and hands the body
over in messages. For a request that is one of the hot routes (``HotPath.take``: no query
string, no ``X-Forwarded-*``, credentials that pass), this protocol skips all of it: it keeps
the body as the parser delivers it and, once the message is complete, runs
``HotPath.answer`` (the same handler, validation, answer and problem+json) in a task of its
own, then writes the answer in one write (``HotPath.wire``: uvicorn's headers in uvicorn's
order) and counts and logs it as ``ObserveMiddleware`` does. On this machine that took
uvicorn's own cost of a request from about 100 µs to about 40 (``docs/benchmarks.md``).

Only a request that arrives on an idle connection (no answer in progress, nothing
pipelined), HTTP/1.1 kept alive, with a ``Content-Length`` within the body limit (or a
``GET`` with no body length), never a chunked body, no ``Expect``, and writes not paused, is
taken; any other goes to uvicorn as before. A request the fast path hands on (``Fallback``: a
body that does not validate, say) becomes uvicorn's cycle with its body already read and goes
to the full stack under ``HotPath`` (``HotPath.inner``), which answers it exactly as before.
While an answer is being made the connection holds a placeholder cycle, so requests pipelined
behind it wait their turn in uvicorn's pipeline, and a shutdown closes the connection after
the answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.server.bypass.hot import HotPath, Taken
from app.store.lease_clock import IN_FLIGHT


class _Answering(RequestResponseCycle):
    """The placeholder cycle of a request answered here: what the protocol's own methods
    read and set on ``self.cycle`` (complete, disconnected, kept alive, its event)."""

    def __init__(self) -> None:  # no super().__init__(): nothing of an ASGI cycle is used
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True
        self.message_event = asyncio.Event()


class WireProtocol(HttpToolsProtocol):
    _hot: tuple[Taken, list[bytes]] | None = None
    _answering: _Answering | None = None
    _handed_on: RequestResponseCycle | None = None  # a cold answer not in self.cycle

    def _hot_begin(self) -> bool:
        """At the end of a request's head: take it when it is a hot route's (see the module)."""
        hot = self.app
        if not isinstance(hot, HotPath):
            return False
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline:
            return False
        parser = self.parser
        url = self.url
        if (
            self.flow.write_paused
            or self.expect_100_continue
            or url[:1] != b"/"
            or b"?" in url
            or b"%" in url
            or b"#" in url
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
        ):
            return False
        method = parser.get_method().decode("ascii")
        if not self._sized(hot.limit, bodyless=method == "GET"):
            return False
        try:
            path = url.decode("ascii")
        except UnicodeDecodeError:
            return False
        scope: Any = self.scope
        scope["method"] = method
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + url
        scope["query_string"] = b""
        taken = hot.take(method, scope["path"], self.headers, scope)
        if taken is None:
            return False
        scope["arrived"] = time.monotonic()  # its renewals are judged at it (lease_clock)
        self._hot = (taken, [])
        return True

    def _sized(self, limit: int, *, bodyless: bool) -> bool:
        """A ``Content-Length`` within ``limit``, or none for a ``bodyless`` method: a body
        the parser bounds. A chunked one, whatever the method, goes to uvicorn, whose flow
        control bounds what it holds (this path pauses nothing)."""
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return False
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return False
                length = int(value)
        return bodyless if length is None else length <= limit

    def _hot_body(self, body: bytes) -> bool:
        if self._hot is None:
            return False
        self._hot[1].append(body)
        return True

    def _hot_complete(self) -> bool:
        """The message is complete: answer it in a task; the placeholder holds the turn."""
        if self._hot is None:
            return False
        taken, chunks = self._hot
        self._hot = None
        scope: Any = self.scope
        raw = b"".join(chunks) if scope["method"] != "GET" else None
        hot = self.app
        assert isinstance(hot, HotPath)
        self.cycle = answering = self._answering = _Answering()
        task = self.loop.create_task(self._hot_answer(hot, scope, taken, raw, answering))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if scope["path"].endswith("/heartbeat"):  # the sweeper spares leases it reached in time
            token = IN_FLIGHT.begin(scope["arrived"])  # ended however the task ends
            task.add_done_callback(lambda _: IN_FLIGHT.end(token))
        return True

    async def _hot_answer(
        self, hot: HotPath, scope: Any, taken: Taken, raw: bytes | None, answering: _Answering
    ) -> None:
        started = time.perf_counter()
        try:
            answer = await hot.answer(scope, taken, raw)  # every Exception is a problem answer
        finally:
            if self._answering is answering:
                self._answering = None
        if answering.disconnected or self.transport.is_closing():
            answering.response_complete = True
            return
        if answer is None:
            self._cold(scope, raw, answering, hot)
            return
        status, headers, body = answer
        keep_alive = answering.keep_alive
        self.transport.write(
            hot.wire(status, headers, body, self.server_state.default_headers, keep_alive)
        )
        answering.response_started = answering.response_complete = True
        if not keep_alive:
            self.transport.close()
        hot.finish(scope, status, started)
        self.on_response_complete()

    def _cold(self, scope: Any, raw: bytes | None, answering: _Answering, hot: HotPath) -> None:
        """The full stack answers the request, its body already read, in the turn it had."""
        cycle = RequestResponseCycle(
            scope=scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=answering.keep_alive,
            on_response=self.on_response_complete,
        )
        cycle.body = bytearray(raw or b"")
        cycle.more_body = False
        cycle.message_event.set()  # what uvicorn's on_message_complete does: the body is all here
        if self.cycle is answering:
            self.cycle = cycle
        else:  # a request pipelined behind holds self.cycle: this one is told of a loss here
            self._handed_on = cycle
        self._start_asgi_task(cycle, cast(ASGI3Application, hot.inner))

    def _hot_lost(self) -> None:
        """The connection is gone: an answer being made here is not written."""
        self._hot = None
        for cycle in (self._answering, self._handed_on):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
