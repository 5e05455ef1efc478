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

from app.server.bypass.inline import Waiting
from app.server.bypass.keepalive import EXTENSION, WRITE_LIMIT, Renewer, pong_frame, text_frame

log = logging.getLogger("app")


class KeepAliveWire(WebSocketsSansIOProtocol):
    _buffer = b""
    _slow = False  # the fast path is off for this connection
    _busy = False  # a renewal is being answered
    _waiting: deque[tuple[bytes, float]] | None = None
    _wire: Renewer | None = None  # the route's, once the stream is open
    _heard = 0.0  # loop time of the last renewal read here

    def send_keepalive_ping(self) -> None:
        """uvicorn's keep-alive ping (``--ws-ping-interval``), only when the stream is quiet:
        a renewal read within the interval shows the client alive as a pong would, so the
        ping waits until the interval has passed since it (at the fleet's pace, every 10 s,
        none is sent: a ping and its pong cost about a renewal's CPU)."""
        interval = self.ping_interval
        quiet = self.loop.time() - self._heard
        if self._wire is not None and interval and quiet < interval:
            self.ping_timer = self.loop.call_later(interval - quiet, self.send_keepalive_ping)
            return
        super().send_keepalive_ping()

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
        out: list[bytes] = []  # the answers of this read, written at once, in order
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
                self._flush(out)
                super().data_received(buf[pos:])
                return
            if end - pos < head + length:
                break
            start = pos + head
            pos = start + length
            if b0 == 0x89 and length < 126:  # a ping: its pong, in order with the answers
                out.append(pong_frame(apply_mask(buf[start:pos], buf[start - 4 : start])))
                continue
            if b0 != 0x81:  # a pong or a close (a ping's state, too): uvicorn's protocol
                self._flush(out)  # the answers before it go first
                super().data_received(buf[start - head : pos])
                if self._renewer() is None:
                    self._buffer = b""
                    if pos < end:
                        super().data_received(buf[pos:])
                    return
                continue
            payload = apply_mask(buf[start:pos], buf[start - 4 : start])
            self._heard = self.loop.time()
            if self._busy:  # a renewal waits (a task): this one after it, in order
                if self._waiting is None:
                    self._waiting = deque()
                self._waiting.append((payload, time.monotonic()))
            else:
                self._run(renewer, payload, time.monotonic(), out)
        self._buffer = buf[pos:]
        self._flush(out)

    def _run(self, renewer: Renewer, payload: bytes, arrived: float, out: list[bytes]) -> None:
        """One renewal: its answer added to ``out`` when it needed no wait, else its task."""
        try:
            got = renewer.renew(payload, arrived)
        except Exception:
            log.exception("keep-alive renewal failed")
            self.transport.close()
            return
        if isinstance(got, Waiting):
            self._busy = True
            self.tasks.add(got.task)  # type: ignore[arg-type]  # uvicorn's set of the tasks
            got.task.add_done_callback(self._done)
        elif got is not None:
            out.append(text_frame(got))

    def _flush(self, out: list[bytes]) -> None:
        if not out:
            return
        transport = self.transport
        if not (self.close_sent or transport.is_closing()):
            transport.write(out[0] if len(out) == 1 else b"".join(out))
            if transport.get_write_buffer_size() > WRITE_LIMIT:
                log.warning("keep-alive stream cut off: its client reads no answers")
                transport.close()
        out.clear()

    def _done(self, task: asyncio.Task[bytes | None]) -> None:
        self.tasks.discard(task)
        self._busy = False
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("keep-alive renewal failed", exc_info=task.exception())
            self.transport.close()
            return
        answer = task.result()
        out = [] if answer is None else [text_frame(answer)]
        renewer = self._wire  # the renewals read before a switch to uvicorn's path, too
        while self._waiting and not self._busy and renewer is not None:
            if self.close_sent or self.transport.is_closing():
                break
            self._run(renewer, *self._waiting.popleft(), out)
        self._flush(out)
