"""Keep-alive renewals (``GET /keepalive``): a message read as a renewal and answered (the route's
loop and the connection's protocol, `app.server.bypass.keepalive_wire`, share these).

The route (``app/api/routes/keepalive.py``) does the upgrade through the whole stack (auth,
the limit, the idle deadline, revocation) and then, when the connection's protocol is
:class:`KeepAliveWire`, hands it a :class:`Renewer` (the ASGI extension ``keepalive.wire``).
From then on each renewal is read from the connection's bytes here, without uvicorn's and
``websockets``' per-message machinery (the frame parser's generator, an ``asyncio.Queue``, the
ASGI ``receive``/``send`` hop), answered by the same :class:`Answers` the route uses, and
written as one unmasked text frame. A renewal runs on the protocol's stack until it first
waits (``inline.run_inline``: on SQLite it never does, so no task a renewal); the answers of
one read go out in one write. That took the stream's own share of a renewal from about 100 µs
to a few tens (``docs/benchmarks.md``).

Only a whole, final, masked text frame of at most ``FAST_MAX`` bytes is read here, and a ping
(a client's keep-alive, every 20 s from ``websockets``: answered with its pong, in order). A
pong or a close goes to uvicorn's protocol as it is, at a frame boundary, so its parser's
state (the server's own pings) stays right; anything else (a fragmented message, a binary or
larger frame) turns the fast path off for the connection, and the route's loop answers from
then on.
Renewals are answered one at a time, in order (one that waits holds the next ones back, unread);
a text frame that is not UTF-8 closes the stream (1007); a client that stops reading its
answers is cut off (the connection aborted) past ``WRITE_LIMIT`` bytes unread.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Protocol

from pydantic import ValidationError
from starlette.types import Scope

from app.core.errors import InvalidRequest, RegistryError, at_edge
from app.core.problems import problem_answer
from app.core.schemas import GROUP_ID_PATTERN, HeartbeatsRequest
from app.registry import Registry
from app.security.auth import check_scope
from app.server.bypass.fastpath import heartbeats_json
from app.server.bypass.inline import Waiting
from app.store import Unavailable
from app.store.lease_clock import ARRIVED, IN_FLIGHT

log = logging.getLogger("app")

EXTENSION = "keepalive.wire"  # scope["extensions"]: this protocol; its "renewer" once handed
FAST_MAX = 65_535  # the longest frame read here (a 16-bit length)
WRITE_LIMIT = 1 << 20  # answers a client leaves unread before it is cut off
_GROUP = re.compile(GROUP_ID_PATTERN)


def parse_renewal(data: Any) -> tuple[str, HeartbeatsRequest]:
    """A message's group and heartbeat, else ``InvalidRequest`` naming what is wrong."""
    try:  # bytes as UTF-8, as a text frame's (json.loads would guess UTF-16 or -32 from NULs)
        message = json.loads(data.decode() if isinstance(data, bytes) else data)
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


class Answers:
    """One stream's renewals answered: the REST batch heartbeat's body, or its problem+json.
    A node sends the same message every interval, so the last one read is kept parsed (its
    bytes compared, nothing else reused: the scope is checked and the leases renewed each
    time), and the ``renewed`` counter's child is looked up once, for the stream."""

    def __init__(self, scope: Scope, registry: Registry) -> None:
        self.scope = scope
        self.registry = registry
        self._last: tuple[Any, str, HeartbeatsRequest] | None = None
        self._renewed = registry.metrics.keepalive_renewals.labels("renewed")

    def parse(self, data: Any) -> tuple[str, HeartbeatsRequest]:
        last = self._last
        if last is not None and last[0] == data:
            return last[1], last[2]
        gid, body = parse_renewal(data)
        self._last = (data, gid, body)
        return gid, body

    async def answer(self, data: Any, arrived: float) -> bytes:
        """One renewal's answer, judged at ``arrived`` and held in flight for the sweeper."""
        gid = "-"
        try:
            gid, body = self.parse(data)
            check_scope(self.scope, gid, "the group")
            ARRIVED.set(arrived)  # judged at its arrival (lease_clock.py)
            token = IN_FLIGHT.begin(arrived)
            try:
                renewed = await self.registry.renew_agents(gid, body.engine_id, body.ranks)
            finally:
                IN_FLIGHT.end(token)
            self._renewed.inc()
            return heartbeats_json(renewed)
        except (RegistryError, Unavailable) as exc:
            problem = at_edge(exc)
            self.registry.metrics.keepalive_renewals.labels(problem.code).inc()
            where = {
                "path": f"/tp-groups/{gid}/engine/agents/heartbeat",
                "app": self.scope.get("app"),
            }
            return problem_answer(problem, where)[2]


class Renewer(Protocol):
    """What the route hands the protocol: a renewal's answer (``None``: the stream ended), at
    once where it needed no wait, else the task that finishes it (``inline.run_inline``)."""

    def renew(self, data: bytes, arrived: float) -> bytes | Waiting[bytes | None] | None: ...


def pong_frame(ping: bytes) -> bytes:
    """A server's pong to a ping's (at most 125-byte) payload (RFC 6455 5.5.3)."""
    return b"\x8a" + bytes((len(ping),)) + ping


def text_frame(payload: bytes) -> bytes:
    """A server's (unmasked) final text frame."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65_536:
        return bytes((0x81, 126)) + n.to_bytes(2, "big") + payload
    return bytes((0x81, 127)) + n.to_bytes(8, "big") + payload
