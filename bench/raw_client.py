"""A lean HTTP/1.1 load client on asyncio's protocols, for loads one aiohttp process cannot make.

The fleet benchmark's client plays 12,500 nodes heartbeating every 10 s (1,250 requests a
second) beside the registry on the same 2 cores. aiohttp spent about 0.8 ms of its own CPU a
request there (``bench/fleet.py``'s ceiling row: 10% of a core for 125 heartbeats a second),
so at 100,000 ranks the client alone needed a whole core, fell behind its schedule, and the
leases it failed to renew lapsed: the run measured the client, not the registry. This client
sends prepared bytes on kept-alive connections and reads an answer by its ``content-length``:
a request and its answer cost a few tens of microseconds of Python.

Only what the benchmarks need: JSON bodies, answers with ``content-length`` (the registry's
and ``bench.minimal``'s always have one), one request at a time on a connection, a pool of at
most ``size`` connections (a request waits for a free one), a connection the server closed is
replaced and the request sent again (once).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buf[:end]).lower()
        if b"\r\ntransfer-encoding:" in head:  # not spoken here: fail loudly, never misparse
            raise ValueError("raw_client reads answers with a content-length only")
        at = head.find(b"\r\ncontent-length:")
        length = 0
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop >= 0 else len(head)])
        if len(self.buf) < end + 4 + length:
            return
        status = int(self.buf[9:12])
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        if b"\r\nconnection: close" in head:
            self.closed = True
        waiter, self.waiter = self.waiter, None
        if not waiter.done():
            waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("the server closed the connection"))


class RawPool:
    """Up to ``size`` kept-alive connections to ``host:port``."""

    def __init__(self, host: str, port: int, size: int) -> None:
        self.host, self.port, self.size = host, port, size
        self._idle: deque[_Conn] = deque()
        self._open = 0
        self._free = asyncio.Condition()
        self.reconnects = 0

    @staticmethod
    def prepare(method: str, path: str, body: Any = None) -> bytes:
        """The request's bytes (send them with ``send``; a heartbeat's never change)."""
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = f"{method} {path} HTTP/1.1\r\nhost: registry\r\n"
        if body is not None:
            head += "content-type: application/json\r\n"
        return f"{head}content-length: {len(data)}\r\n\r\n".encode() + data

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, raw = await self.send(self.prepare(method, path, body))
        return status, (json.loads(raw) if raw else None)

    async def send(self, request: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            conn = await self._take()
            try:
                loop = asyncio.get_running_loop()
                conn.waiter = loop.create_future()
                assert conn.transport is not None
                conn.transport.write(request)
                return await conn.waiter
            except ConnectionError:
                conn.closed = True
                self.reconnects += 1
                if attempt:
                    raise
            finally:
                await self._give(conn)
        raise AssertionError("unreachable")

    async def _take(self) -> _Conn:
        async with self._free:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.closed:
                        return conn
                    self._open -= 1
                if self._open < self.size:
                    self._open += 1
                    break
                await self._free.wait()
        try:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except OSError:
            async with self._free:
                self._open -= 1
                self._free.notify()
            raise
        return conn

    async def _give(self, conn: _Conn) -> None:
        async with self._free:
            if conn.closed:
                self._open -= 1
                if conn.transport is not None:
                    conn.transport.close()
            else:
                self._idle.append(conn)
            self._free.notify()

    def close(self) -> None:
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None:
                conn.transport.close()
        self._open = 0
