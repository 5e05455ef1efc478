"""``python -m bench.ws_floor PORT [--answer-bytes N]``: the floor of a keep-alive renewal on the
registry's event loop, a minimal WebSocket server (``bench.keepalive``'s ``floor`` mode).

uvloop, as uvicorn runs the registry (``app/server/serve.py``), and one ``asyncio.Protocol`` a
connection: it answers the HTTP upgrade (101, ``Sec-WebSocket-Accept`` of RFC 6455), then for
each whole masked text frame unmasks it (``apply_mask``, the registry's helper) and writes one
unmasked text frame of ``--answer-bytes`` bytes (the registry's renewal answer's length) in one
write. A ping is answered with a pong, a close with a close. No JSON, no lease work, no task:
"read a frame, write a frame" on this loop, whatever many frames a wakeup brings.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import uvloop
from websockets.speedups import apply_mask

from app.server.bypass.keepalive import pong_frame, text_frame
from bench.common import HOST, process

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3
HEAD_MAX = 16_384  # an upgrade request's longest head
ANSWER_BYTES = 420  # a TP 8 node's renewal answer (``bench.keepalive`` measures its own)


def accept_key(key: bytes) -> bytes:
    """``Sec-WebSocket-Accept`` for a ``Sec-WebSocket-Key``."""
    return base64.b64encode(hashlib.sha1(key + GUID).digest())


def upgrade_answer(head: bytes) -> bytes | None:
    """The 101 answer to an upgrade request's head, ``None`` without a key."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-key":
            return (
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
                + accept_key(value.strip())
                + b"\r\n\r\n"
            )
    return None


class FloorProtocol(asyncio.Protocol):
    """One connection: the upgrade, then a fixed text frame for each text frame read."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer  # a whole frame, written as it is
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        buf = self.buffer + data if self.buffer else data
        if not self.open:
            end = buf.find(b"\r\n\r\n")
            answer = upgrade_answer(buf[:end]) if end >= 0 else None
            if answer is None:
                if end >= 0 or len(buf) > HEAD_MAX:
                    transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    transport.close()
                self.buffer = buf
                return
            transport.write(answer)
            self.open, buf = True, buf[end + 4 :]
        pos, size = 0, len(buf)
        while size - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length, head = b1 & 0x7F, 6
            if length == 126:
                if size - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 8
            if b1 & 0x80 == 0 or length == 127 or b0 not in (0x81, 0x88, 0x89, 0x8A):
                transport.close()  # not a frame this floor reads (and no client here sends it)
                return
            if b0 != 0x81 and length > 125:
                transport.close()  # a control frame's payload is at most 125 bytes
                return
            if size - pos < head + length:
                break
            start = pos + head
            pos = start + length
            if b0 == 0x81:
                apply_mask(buf[start:pos], buf[start - 4 : start])
                transport.write(self.answer)
            elif b0 == 0x89:  # ping: a pong with its payload
                transport.write(pong_frame(apply_mask(buf[start:pos], buf[start - 4 : start])))
            elif b0 == 0x88:  # close: echo it, then end
                transport.write(b"\x88\x00")
                transport.close()
                return
        self.buffer = buf[pos:]


async def serve(port: int, answer_bytes: int) -> None:
    frame = text_frame(b"x" * answer_bytes)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FloorProtocol(frame), HOST, port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def floor_server(port: int, answer_bytes: int, timeout_s: float = 20.0) -> Iterator[int]:
    """Run the floor as a process on ``port`` for the block (``bench.common.process``: stopped
    on the way out); yields its pid."""
    cmd = [sys.executable, "-m", "bench.ws_floor", str(port), "--answer-bytes", str(answer_bytes)]
    with tempfile.TemporaryDirectory(prefix="bench-ws-floor-") as tmp:
        log = Path(tmp) / "floor.log"
        with process(cmd, log=log) as proc:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    said = log.read_text(errors="replace")[-500:]
                    raise RuntimeError(f"bench.ws_floor exited with {proc.returncode}: {said}")
                with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.5):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"bench.ws_floor took no connection on {port} in {timeout_s} s"
                    )
                time.sleep(0.05)
            yield proc.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--answer-bytes", type=int, default=ANSWER_BYTES)
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.port, args.answer_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
