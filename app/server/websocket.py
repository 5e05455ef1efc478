"""The WebSocket connection's protocol (keep-alive streams), the same with the fast path on or
off: uvicorn's sans-I/O WebSocket protocol, whose deadlines end the connection.

uvicorn ends a stream at a deadline with ``transport.close()``, which waits for the write
buffer to flush, and the app's close first waits until writes resume: a client that stops
reading (its receive window at zero) would keep the connection, its buffers and its keep-alive
slot for good. Here a close that cannot be written ends the connection at once
(``transport.abort()``): the app's close (the idle deadline) while writes are paused, the
keep-alive ping's timeout and the close handshake's timeout with answers still unsent.

uvicorn parses every frame of a read into its queue and the app takes them without waiting:
a flood of small messages would keep the loop for the whole read (thousands of renewals).
Here the app's ``receive`` yields to the loop every ``BATCH`` messages, as the fast path's
protocol (`app.server.bypass.keepalive_wire`, a subclass) answers at most ``BATCH`` a turn.

uvicorn and websockets log three info lines a stream ("connection open", ``"WebSocket
/keepalive" [accepted]``, "connection closed"), outside the access log's budget: 37,500 lines
for a 12,500-node fleet's streams opening and closing, together a tenth of an open's CPU.
Here they go to ``QUIET`` (``uvicorn.error.websocket``), which ``app.core.logs.configure``
holds at warning unless the log level is debug; its errors still show. The upgrade's own line
is the access log's (``ObserveMiddleware``: one a stream, within the budget).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

BATCH = 32  # messages a stream takes in one turn of the loop before it yields to the others
QUIET = logging.getLogger("uvicorn.error.websocket")


class GuardedWebSocket(WebSocketsSansIOProtocol):
    _taken = 0  # messages the app took in this turn

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = QUIET  # uvicorn's lines ("[accepted]", refusals, errors)
        self.conn.logger = QUIET  # websockets' ("connection open", "connection closed")

    def end_now(self) -> None:
        """Close, or abort where the buffer holds what the client is not reading."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()  # writes the close (1011) and closes: it may never flush
        self.end_now()

    async def send(self, message: Any) -> None:
        closing = message["type"] == "websocket.close"
        if closing and not self.writable.is_set() and not self.disconnected:
            self.transport.abort()  # the close could never be written: the send ends at once
        await super().send(message)
        if closing and self.close_timer is not None:  # the handshake's timeout ends it, too
            self.close_timer.cancel()
            self.close_timer = self.loop.call_later(self.close_timeout, self.end_now)

    async def receive(self) -> Any:
        self._taken += 1
        if self._taken >= BATCH:
            self._taken = 0
            await asyncio.sleep(0)  # the other clients' turn
        return await super().receive()
