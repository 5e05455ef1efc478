"""A fleet node's renewals over the keep-alive stream (``bench/fleet_load.py``, ``renew="stream"``),
as the lease keeper makes them (``workers/keepalive.py``'s ``KeepAliveStream``).

One WebSocket a node (``GET /keepalive``), opened at its first renewal; each renewal one
message ``[group_id, engine_id, [0, …, 7]]`` and its answer. Where there is no stream, the node
renews over REST (``renew`` answers ``None``): the upgrade refused (asked again after
``RETRY_S``, at least its ``Retry-After``), or the stream broken or silent past the renewal's
budget (opened again after a pause of the one back-off policy, from 1 s doubling to
``CAP_S``, as the keeper does), opened with the keeper's ``OPTIONS`` (no pings of its own:
``websockets``' default, a ping every 20 s, added 625 ping-pong exchanges a second at 12,500
nodes to what the registry serves).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from registry_client.backoff import Backoff
from workers.keepalive import CAP_S, OPTIONS, RETRY_S

_STATUS = re.compile(rb'"status":\s*(\d+)')


class NodeStream:
    """One node's stream; ``opened`` and ``refused`` count its upgrades."""

    def __init__(self, url: str, gid: str, eid: str, ranks: list[int]) -> None:
        self.url = url
        self.message = json.dumps([gid, eid, ranks])
        self.ws: ClientConnection | None = None
        self.next_try = 0.0
        self.backoff = Backoff(base_s=1.0, cap_s=CAP_S)
        self.opened = 0
        self.refused: int | None = None  # the last refusal's status

    async def renew(self, budget_s: float) -> int | None:
        """The renewal's status (200, or the problem's), ``None``: no stream (renew over
        REST)."""
        ws = self.ws if self.ws is not None else await self._open(budget_s)
        if ws is None:
            return None
        try:
            async with asyncio.timeout(budget_s):
                await ws.send(self.message)
                answer = await ws.recv(decode=False)
        except (TimeoutError, OSError, WebSocketException):
            await self._broken()
            return None
        if answer.startswith(b'{"agents"'):
            return 200
        found = _STATUS.search(answer)
        return int(found.group(1)) if found else 0

    async def _open(self, budget_s: float) -> ClientConnection | None:
        if time.monotonic() < self.next_try:
            return None
        try:
            self.ws = await connect(self.url, open_timeout=budget_s, max_size=1 << 20, **OPTIONS)
        except InvalidStatus as exc:
            self.refused = exc.response.status_code
            after = exc.response.headers.get("Retry-After", "")
            wait = float(after) if after.isdigit() else 0.0
            self.next_try = time.monotonic() + max(RETRY_S, wait)
            return None
        except (TimeoutError, OSError, WebSocketException):
            await self._broken()
            return None
        self.opened += 1
        self.refused = None
        self.backoff.reset()
        return self.ws

    async def _broken(self) -> None:
        await self.close()
        self.next_try = time.monotonic() + self.backoff.next()

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.transport.abort()  # no close handshake: the run is over, or the stream broke
            await ws.wait_closed()
