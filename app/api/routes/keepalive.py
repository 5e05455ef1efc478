"""``GET /keepalive``: a node's lease renewals over one long-lived WebSocket (etcd's
LeaseKeepAlive), instead of one HTTP request per renewal.

The upgrade is authenticated once, by ``AuthMiddleware`` (a worker token). Each client
message is one renewal, a JSON array ``[group_id, engine_id, [rank, …]]``; the server answers
each, in order, with what ``POST /tp-groups/{group_id}/engine/agents/heartbeat`` would answer:
its ``Heartbeats`` body (``{"agents": [{"rank", "expires_at"}, …]}``) or its problem+json
(``status`` and ``code`` in the object: 404 a rank with no live agent, 409 a superseded
engine, 403 a group outside a scoped token's scope, 422 a malformed message). The renewal is
``Registry.renew_agents``, the REST heartbeat's own, judged at the message's arrival and held
in flight for the lease sweeper (``app/store/lease_clock.py``); the stream is never shed.
Where the connection's protocol reads renewals itself (``app/server/bypass/keepalive.py``),
this route hands it the renewals once the stream is open and keeps the rest: the limit, the
idle deadline, revocation, and any message that protocol passes on.

Every wait has a deadline: a stream with no message for ``REGISTRY_KEEPALIVE_IDLE_S`` is
closed (1000), and a token a tokens-file reload drops ends its streams at once with a last
``401 unauthorized`` answer and a close (1008); one it makes a reader, with ``403 forbidden``.
A reload that changes the token's ``groups=`` applies from the next renewal: the request's
credential is the token's current one (``TokenSource.hold``). At most
``REGISTRY_KEEPALIVE_MAX`` streams are held; past it the upgrade gets ``503 overloaded`` (0:
``404``, the route is off), and the node renews over REST (``workers/keepalive.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.routing import Match, WebSocketRoute
from starlette.types import Receive, Scope, Send

from app.core.errors import NotFound, Overloaded
from app.registry import Registry
from app.security.auth import send_refusal
from app.server.bypass.inline import Waiting, run_inline
from app.server.bypass.keepalive import EXTENSION, Answers

PATH = "/keepalive"


@dataclass
class KeepAliveLimits:
    """``REGISTRY_KEEPALIVE_MAX`` and ``REGISTRY_KEEPALIVE_IDLE_S``, and the streams held."""

    max_streams: int
    idle_s: float
    held: int = 0


class Stream:
    """One held stream, as ``TokenSource.hold`` knows it: ``finish`` ends it (revocation).
    Its idle deadline runs while it waits on its client, never during a renewal (a renewal is
    not cut midway; an end from outside takes effect after it). A renewal only notes when it
    ended; one timer a stream (``_check``) compares that with the deadline when it falls due
    and sets itself again, rather than moving the timer twice a renewal."""

    revision = 0

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self.loop = loop
        self.idle_s = idle_s
        self.deadline: asyncio.Timeout | None = None  # armed at None: ``_check`` expires it
        self.ended: bytes | None = None  # the last answer of a stream ended from outside
        self.reason = ""  # its close's reason
        self.renewing = 0
        self.quiet_since = loop.time()  # the last renewal's end
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, deadline: asyncio.Timeout) -> None:
        self.deadline = deadline
        self.quiet_since = now = self.loop.time()
        self._timer = self.loop.call_at(now + self.idle_s, self._check)
        if self.ended is not None and not self.renewing:
            self._expire(now)  # ended before the wait began

    def unwatch(self) -> None:
        """Before its ``deadline`` exits: an exited ``asyncio.Timeout`` cannot be rescheduled
        (RuntimeError), and a revocation may come after the stream ended."""
        self.deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        now = self.loop.time()
        if self.renewing or now < self.quiet_since + self.idle_s:
            due = now if self.renewing else self.quiet_since
            self._timer = self.loop.call_at(due + self.idle_s, self._check)
            return
        self._timer = None
        self._expire(now)

    def _expire(self, now: float) -> None:
        if self.deadline is not None:
            self.deadline.reschedule(now)  # wakes the stream's wait at once

    def finish(self, line: bytes, *, slow: bool = False) -> None:
        problem = json.loads(line)["object"]  # the watch's ERROR line: its problem
        self.ended = json.dumps(problem, separators=(",", ":")).encode()
        self.reason = "token revoked" if problem["status"] == 401 else "token demoted"
        if not self.renewing:
            self._expire(self.loop.time())

    def begin(self) -> None:
        self.renewing += 1

    def end(self) -> None:
        self.renewing -= 1
        if not self.renewing:
            self.quiet_since = now = self.loop.time()
            if self.ended is not None:
                self._expire(now)


class WireRenewer:
    """The renewals the connection's protocol reads itself (``app.server.bypass.keepalive``),
    one context a stream (its renewals are answered one at a time, in order). On a store
    that answers from this process (``Store.remote_reads`` false: SQLite) a renewal runs on
    the protocol's stack until it waits (``run_inline``); on one whose reads are round trips
    (etcd: its calls need a current task, ``asyncio.timeout``) each is a task."""

    def __init__(self, answers: Answers, stream: Stream) -> None:
        self.answers = answers
        self.stream = stream
        self.context = contextvars.copy_context()
        self.inline = not answers.registry.store.remote_reads

    def renew(self, data: bytes, arrived: float) -> bytes | Waiting[bytes | None] | None:
        if self.stream.ended is not None:
            return None
        renewal = self._renew(data, arrived)
        if not self.inline:
            return Waiting(self.stream.loop.create_task(renewal, context=self.context))
        return run_inline(renewal, self.context, self.stream.loop)

    async def _renew(self, data: bytes, arrived: float) -> bytes | None:
        stream = self.stream
        stream.begin()
        try:
            answer = await self.answers.answer(data, arrived)
        finally:
            stream.end()
        return None if stream.ended is not None else answer


class KeepAlive:
    """The route's ASGI app (a WebSocket route of the app's router)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope["app"].state
        limits: KeepAliveLimits = state.keepalive
        if limits.max_streams == 0:
            off = NotFound(
                "Keep-alive streams are off on this registry (REGISTRY_KEEPALIVE_MAX=0): renew "
                "with POST /tp-groups/{group_id}/engine/agents/heartbeat."
            )
            await send_refusal(send, off, scope, [])
            return
        if limits.held >= limits.max_streams:
            full = Overloaded(
                f"This replica holds {limits.held} keep-alive streams "
                "(REGISTRY_KEEPALIVE_MAX): renew with the REST heartbeat, or retry the stream "
                "after Retry-After seconds."
            )
            await send_refusal(send, full, scope, [(b"retry-after", b"30")])
            return
        if (await receive())["type"] != "websocket.connect":
            return
        limits.held += 1
        try:
            await self.serve(scope, receive, send, limits.idle_s, state)
        finally:
            limits.held -= 1

    async def serve(
        self, scope: Scope, receive: Receive, send: Send, idle_s: float, state: Any
    ) -> None:
        registry: Registry = state.registry
        loop = asyncio.get_running_loop()
        stream = Stream(loop, idle_s)
        answers = Answers(scope, registry)
        state.tokens.hold(stream, scope, "worker")  # its role and groups follow the token's
        wire = scope.get("extensions", {}).get(EXTENSION)
        if wire is not None:  # the protocol reads renewals itself, from the first one on
            wire["renewer"] = WireRenewer(answers, stream)
        try:
            await send({"type": "websocket.accept"})
            async with asyncio.timeout_at(None) as deadline:
                stream.watch(deadline)
                try:
                    if await self.renewals(receive, send, answers, stream):
                        return  # websocket.disconnect: the client went away
                finally:
                    stream.unwatch()
        except TimeoutError:
            if not deadline.expired():
                raise
            if stream.ended is None:
                reason = f"no renewal for {idle_s:g} s (REGISTRY_KEEPALIVE_IDLE_S)"
                await send({"type": "websocket.close", "code": 1000, "reason": reason})
                return
        except OSError:
            return  # the client is gone (uvicorn's ClientDisconnected)
        finally:
            stream.unwatch()
            state.tokens.release(stream)
        assert stream.ended is not None
        try:
            await send({"type": "websocket.send", "text": stream.ended.decode()})
            await send({"type": "websocket.close", "code": 1008, "reason": stream.reason})
        except OSError:
            return

    @staticmethod
    async def renewals(receive: Receive, send: Send, answers: Answers, stream: Stream) -> bool:
        """The route's loop: each message answered in order, until the client goes away
        (True) or the stream is ended from outside (False)."""
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return True
            arrived = time.monotonic()  # the lease clock (lease_clock.py)
            stream.begin()
            try:
                data = message.get("text") or message.get("bytes")
                answer = await answers.answer(data, arrived)
            finally:
                stream.end()
            if stream.ended is not None:
                return False
            await send({"type": "websocket.send", "text": answer.decode()})


class KeepAliveRoute(WebSocketRoute):
    """The route, named in the scope as FastAPI names its own (``scope["route"]``): the
    upgrade's access line and ``registry_http_requests_total`` say ``/keepalive``."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.FULL:
            child["route"] = self
        return match, child


route = KeepAliveRoute(PATH, KeepAlive(), name="keepalive")
