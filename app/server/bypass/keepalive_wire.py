"""Keep-alive renewals read in the WebSocket connection's protocol (`KeepAliveWire`, a subclass
of uvicorn's sans-I/O WebSocket protocol: an internal `app.server.bypass.INTERNALS` checks).
See `app.server.bypass.keepalive` for what the route and this protocol share."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.speedups import apply_mask  # websockets' C mask (uvicorn[standard])

from app.server.bypass.keepalive import (
    EXTENSION,
    WRITE_LIMIT,
    Renewer,
    text_frame,
)

log = logging.getLogger("app")


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
