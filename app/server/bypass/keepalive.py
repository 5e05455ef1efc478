"""Keep-alive renewals (``GET /keepalive``) answered in the WebSocket connection's protocol.

The route (``app/api/routes/keepalive.py``) does the upgrade through the whole stack (auth,
the limit, the idle deadline, revocation) and then, when the connection's protocol is
:class:`KeepAliveWire`, hands it a :class:`Renewer` (the ASGI extension ``keepalive.wire``).
From then on each renewal is read from the connection's bytes here, without uvicorn's and
``websockets``' per-message machinery (the frame parser's generator, an ``asyncio.Queue``, the
ASGI ``receive``/``send`` hop), answered by the same :func:`renewal_answer` the route uses,
and written as one unmasked text frame in one write. That took the stream's own share of a
renewal from about 100 µs to a few tens (``docs/benchmarks.md``).

Only a whole, final, masked text frame of at most ``FAST_MAX`` bytes is read here. A control
frame (ping, pong, close) goes to uvicorn's protocol as it is, at a frame boundary, so its
parser's state stays right; anything else (a fragmented message, a binary or larger frame)
turns the fast path off for the connection, and the route's loop answers from then on.
Renewals are answered one at a time, in order; a client that stops reading its answers is
cut off past ``WRITE_LIMIT`` bytes unread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from typing import Any, Protocol

from pydantic import ValidationError
from starlette.types import Scope
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.speedups import apply_mask  # websockets' C mask (uvicorn[standard])

from app.core.errors import InvalidRequest, RegistryError, at_edge
from app.core.problems import problem_answer
from app.core.schemas import GROUP_ID_PATTERN, HeartbeatsRequest
from app.registry import Registry
from app.security.auth import check_scope
from app.server.bypass.fastpath import heartbeats_json
from app.store import Unavailable
from app.store.lease_clock import ARRIVED, IN_FLIGHT

log = logging.getLogger("app")

EXTENSION = "keepalive.wire"  # scope["extensions"]: this protocol; its "renewer" once handed
FAST_MAX = 65_535  # the longest frame read here (a 16-bit length)
WRITE_LIMIT = 1 << 20  # answers a client leaves unread before it is cut off
_GROUP = re.compile(GROUP_ID_PATTERN)


def parse_renewal(data: Any) -> tuple[str, HeartbeatsRequest]:
    """A message's group and heartbeat, else ``InvalidRequest`` naming what is wrong."""
    try:
        message = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        message = None
    if not (isinstance(message, list) and len(message) == 3 and isinstance(message[0], str)):
        raise InvalidRequest(
            "A keep-alive message is a JSON array [group_id, engine_id, [rank, ...]], "
            'e.g. ["prefill-0", "<engine_id>", [0, 1]].'
        )
    gid, engine_id, ranks = message
    if _GROUP.fullmatch(gid) is None:
        raise InvalidRequest(f"{gid[:80]!r} is not a group id ({GROUP_ID_PATTERN}).")
    try:
        body = HeartbeatsRequest.model_validate({"engine_id": engine_id, "ranks": ranks})
    except ValidationError as exc:
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidRequest(f"The keep-alive message is invalid: {where}") from None
    return gid, body


async def renewal_answer(scope: Scope, registry: Registry, data: Any, arrived: float) -> bytes:
    """One renewal's answer: the REST batch heartbeat's body, or its problem+json."""
    gid = "-"
    try:
        gid, body = parse_renewal(data)
        check_scope(scope, gid, "the group")
        ARRIVED.set(arrived)  # judged at its arrival, held for the sweeper (lease_clock.py)
        token = IN_FLIGHT.begin(arrived)
        try:
            renewed = await registry.renew_agents(gid, body.engine_id, body.ranks)
        finally:
            IN_FLIGHT.end(token)
        return heartbeats_json(renewed)
    except (RegistryError, Unavailable) as exc:
        where = {"path": f"/tp-groups/{gid}/engine/agents/heartbeat", "app": scope.get("app")}
        return problem_answer(at_edge(exc), where)[2]


class Renewer(Protocol):
    """What the route hands the protocol: a renewal's answer (``None``: the stream ended)."""

    async def renew(self, data: bytes, arrived: float) -> bytes | None: ...


def text_frame(payload: bytes) -> bytes:
    """A server's (unmasked) final text frame."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65_536:
        return bytes((0x81, 126)) + n.to_bytes(2, "big") + payload
    return bytes((0x81, 127)) + n.to_bytes(8, "big") + payload


class KeepAliveWire(WebSocketsSansIOProtocol):
    _buffer = b""
    _slow = False  # the fast path is off for this connection
    _busy = False  # a renewal is being answered
    _waiting: deque[tuple[bytes, float]] | None = None
    _wire: Renewer | None = None  # the route's, once the stream is open

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope: Any = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][EXTENSION] = {}

    def _renewer(self) -> Renewer | None:
        if self._slow or not self.handshake_complete or self.close_sent:
            return None
        if self._wire is None:
            extensions: dict[str, Any] = self.scope["extensions"] or {}
            self._wire = extensions.get(EXTENSION, {}).get("renewer")
        return self._wire

    def data_received(self, data: bytes) -> None:
        renewer = self._renewer()
        if renewer is None:
            super().data_received(data)
            return
        buf = self._buffer + data if self._buffer else data
        pos, end = 0, len(buf)
        while end - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length, head = b1 & 0x7F, 6
            if length == 126:
                if end - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 8
            if b1 & 0x80 == 0 or length == 127 or (b0 != 0x81 and not 0x88 <= b0 <= 0x8A):
                self._slow = True  # not for this path: uvicorn's reads the rest
                self._buffer = b""
                super().data_received(buf[pos:])
                return
            if end - pos < head + length:
                break
            start = pos + head
            pos = start + length
            if b0 != 0x81:  # a ping, pong or close: uvicorn's protocol, as it is
                super().data_received(buf[start - head : pos])
                if self._renewer() is None:
                    self._buffer = b""
                    if pos < end:
                        super().data_received(buf[pos:])
                    return
                continue
            self._take(renewer, apply_mask(buf[start:pos], buf[start - 4 : start]))
        self._buffer = buf[pos:]

    def _take(self, renewer: Renewer, payload: bytes) -> None:
        arrived = time.time()
        if self._busy:
            if self._waiting is None:
                self._waiting = deque()
            self._waiting.append((payload, arrived))
            return
        self._start(renewer, payload, arrived)

    def _start(self, renewer: Renewer, payload: bytes, arrived: float) -> None:
        self._busy = True
        task = self.loop.create_task(renewer.renew(payload, arrived))
        self.tasks.add(task)  # type: ignore[arg-type]  # uvicorn's set of the server's tasks
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[bytes | None]) -> None:
        self.tasks.discard(task)
        self._busy = False
        transport = self.transport
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("keep-alive renewal failed", exc_info=task.exception())
            transport.close()
            return
        answer = task.result()
        if answer is None or self.close_sent or transport.is_closing():
            return
        transport.write(text_frame(answer))
        if transport.get_write_buffer_size() > WRITE_LIMIT:
            log.warning("keep-alive stream cut off: its client reads no answers")
            transport.close()
            return
        renewer = self._renewer()
        if self._waiting and renewer is not None:
            self._start(renewer, *self._waiting.popleft())
