"""Keep-alive renewals read in the WebSocket connection's protocol (`KeepAliveWire`, a subclass
of the guarded sans-I/O WebSocket protocol, `app.server.websocket`: an internal of uvicorn that
`app.server.bypass.INTERNALS` checks). See `app.server.bypass.keepalive` for what the route and
this protocol share.

Reading is bounded as uvicorn bounds it for the route: frames are answered at most ``BATCH`` in
one turn of the loop (a flooding stream yields to every other client between batches), and
while whole frames wait (the batch used, or a renewal in a task: etcd) reading is paused, so
what waits is at most one read of the socket."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from websockets.speedups import apply_mask  # websockets' C mask (uvicorn[standard])

from app.server.bypass.inline import Waiting
from app.server.bypass.keepalive import EXTENSION, WRITE_LIMIT, Renewer, pong_frame, text_frame
from app.server.websocket import BATCH, GuardedWebSocket

log = logging.getLogger("app")


class KeepAliveWire(GuardedWebSocket):
    _buffer = b""  # bytes read and not yet answered (whole frames only while reading is held)
    _slow = False  # the fast path is off for this connection
    _busy = False  # a renewal is being answered (a task): the frames after it wait
    _held = False  # reading is paused here
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
        if self._renewer() is None and not self._buffer:
            super().data_received(data)
            return
        self._buffer = self._buffer + data if self._buffer else data
        if not self._busy:
            self._read()

    def _hand_over(self, rest: bytes) -> None:
        """The rest of the bytes are uvicorn's protocol's (its reading, its own pauses)."""
        self._buffer = b""
        self._release()
        if rest:
            super().data_received(rest)

    def _read(self) -> None:
        """Answer the whole frames read, at most ``BATCH`` now: the answers in one write."""
        if self.transport.is_closing():
            self._buffer = b""
            return
        renewer = self._renewer()
        buf = self._buffer
        if renewer is None:
            self._hand_over(buf)
            return
        out: list[bytes] = []  # the answers of this batch, written at once, in order
        pos, end, budget = 0, len(buf), BATCH
        while end - pos >= 2 and budget and not self._busy:
            b0, b1 = buf[pos], buf[pos + 1]
            length, head = b1 & 0x7F, 6
            if length == 126:
                if end - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 8
            if b1 & 0x80 == 0 or length == 127 or (b0 != 0x81 and not 0x88 <= b0 <= 0x8A):
                self._slow = True  # not for this path: uvicorn's reads the rest
                self._flush(out)
                self._hand_over(buf[pos:])
                return
            if end - pos < head + length:
                break
            budget -= 1
            start = pos + head
            pos = start + length
            if b0 == 0x89 and length < 126:  # a ping: its pong, in order with the answers
                out.append(pong_frame(apply_mask(buf[start:pos], buf[start - 4 : start])))
                continue
            if b0 != 0x81:  # a pong or a close (a ping's state, too): uvicorn's protocol
                self._flush(out)  # the answers before it go first
                super().data_received(buf[start - head : pos])
                if self._renewer() is None:
                    self._hand_over(buf[pos:])
                    return
                continue
            payload = apply_mask(buf[start:pos], buf[start - 4 : start])
            if not self._utf8(payload):
                self._flush(out)
                return
            self._heard = self.loop.time()
            self._run(renewer, payload, time.monotonic(), out)
        self._buffer = buf[pos:]
        self._flush(out)
        if self._busy or not budget:  # frames may wait: read no more until they are answered
            self._hold()
            if not self._busy:
                self.loop.call_soon(self._read)  # the next batch after the others' turn
        else:
            self._release()

    def _utf8(self, payload: bytes) -> bool:
        """A text frame is UTF-8, else the stream closes with 1007 (as uvicorn's own path)."""
        try:
            payload.decode()
        except UnicodeDecodeError:
            self._buffer = b""
            self._release()
            self.conn.send_close(1007, "invalid UTF-8")
            self.handle_parser_exception()
            return False
        return True

    def _hold(self) -> None:
        if not self._held and not self.transport.is_closing():
            self._held = True
            self.transport.pause_reading()

    def _release(self) -> None:
        if self._held:
            self._held = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

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
                transport.abort()  # a close would wait for the unread answers to flush
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
        if answer is not None:
            self._flush([text_frame(answer)])
        if not self.transport.is_closing():
            self._read()  # the frames that waited, then reading again
