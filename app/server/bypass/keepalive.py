"""Keep-alive renewals (``GET /keepalive``): a message read as a renewal and answered (the route's
loop and the connection's protocol, `app.server.bypass.keepalive_wire`, share these).

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
        registry.metrics.keepalive_renewals.labels("renewed").inc()
        return heartbeats_json(renewed)
    except (RegistryError, Unavailable) as exc:
        problem = at_edge(exc)
        registry.metrics.keepalive_renewals.labels(problem.code).inc()
        where = {"path": f"/tp-groups/{gid}/engine/agents/heartbeat", "app": scope.get("app")}
        return problem_answer(problem, where)[2]


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
