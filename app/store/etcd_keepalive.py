"""Lease renewals on a few long-lived ``LeaseKeepAlive`` streams of a member's channel.

etcd renews a lease only through the bidirectional ``LeaseKeepAlive`` stream, and answers a
stream's requests one after another, in order (an unknown lease: ``TTL`` 0). Opening a stream
a renewal (a call, its write, half-close, read and cancel) cost this process 320-800 µs of
CPU a renewal on the 2-core machine, one long-lived stream 180-310 µs (``bench/README.md``).
So a member's renewals go through ``STREAMS`` streams opened on first use: each has a writer
task that writes queued requests one at a time (gRPC allows one write in flight a call) and a
reader task that hands each answer to the oldest waiting renewal. A renewal goes to the
stream with the fewest waiting.

A renewal waits at most its ``seconds`` (the caller's deadline; ``TimeoutError`` then, and a
request not yet written is skipped). A stream that fails or ends fails every renewal it holds
with ``ConnectionError`` and is opened again by the next renewal: the caller's failover
(``etcd_cluster``) tries the next member within the same deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass

import aetcd
import grpc  # type: ignore[import-untyped]
from aetcd import rpc

STREAMS = 4


@dataclass(frozen=True, slots=True)
class Renewed:
    """etcd's answer: the lease's TTL now (0: etcd no longer has it) and the store revision
    of the member that answered, at the renewal."""

    ttl: int
    revision: int


class _Stream:
    def __init__(self, client: aetcd.Client) -> None:
        self._call = client.leasestub.LeaseKeepAlive()
        self._queued: collections.deque[tuple[int, asyncio.Future[Renewed]]] = collections.deque()
        self._sent: collections.deque[tuple[int, asyncio.Future[Renewed]]] = collections.deque()
        self._wake = asyncio.Event()
        self.failure: BaseException | None = None
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    @property
    def waiting(self) -> int:
        return len(self._queued) + len(self._sent)

    def send(self, lease_id: int) -> asyncio.Future[Renewed]:
        done: asyncio.Future[Renewed] = asyncio.get_running_loop().create_future()
        self._queued.append((lease_id, done))
        self._wake.set()
        return done

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queued:
                    lease_id, done = self._queued.popleft()
                    if done.done():  # its caller's deadline passed while it was queued
                        continue
                    self._sent.append((lease_id, done))
                    await self._call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    async def _read(self) -> None:
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("etcd ended the lease keep-alive stream")
                if not self._sent:
                    raise ConnectionError("etcd answered a lease renewal nobody asked for")
                lease_id, done = self._sent.popleft()
                if int(reply.ID) != lease_id:
                    raise ConnectionError(f"etcd answered lease {reply.ID} for lease {lease_id}")
                if not done.done():
                    done.set_result(Renewed(int(reply.TTL), int(reply.header.revision)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._call.cancel()
        error = ConnectionError(f"the lease keep-alive stream ended: {self.failure!r}")
        waiting = [done for _, done in (*self._sent, *self._queued)]
        self._sent.clear()
        self._queued.clear()
        for done in waiting:
            if not done.done():
                done.set_exception(error)

    def close(self) -> None:
        self._fail(ConnectionError("the store is closing"))


class KeepAlives:
    """The renewal streams of one member's channel (``client``)."""

    def __init__(self, client: aetcd.Client, streams: int = STREAMS) -> None:
        self._client = client
        self._streams: list[_Stream | None] = [None] * streams

    async def renew(self, lease_id: int, seconds: float) -> Renewed:
        best = 0
        for index, stream in enumerate(self._streams):
            if stream is None or stream.failure is not None:
                stream = self._streams[index] = _Stream(self._client)
            held = self._streams[best]
            if held is not None and stream.waiting < held.waiting:
                best = index
            if not stream.waiting:
                best = index
                break
        held = self._streams[best]
        assert held is not None
        # Past the deadline the renewal is cancelled: unwritten, it is skipped; written, its
        # answer is dropped.
        async with asyncio.timeout(seconds):
            return await held.send(lease_id)

    def close(self) -> None:
        for stream in self._streams:
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        self._streams = [None] * len(self._streams)
