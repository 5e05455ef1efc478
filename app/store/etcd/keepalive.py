"""Lease renewals on a member's pool of long-lived ``LeaseKeepAlive`` streams.

etcd renews a lease only through the bidirectional ``LeaseKeepAlive`` stream. Opening one a
renewal (the call, its write, half-close, read and cancel) cost this process 320-800 µs of
CPU a renewal on the 2-core machine; a renewal on a stream already open costs a write and a
read (``docs/benchmarks.md``). But etcd answers a stream's requests one after another, and a
renewal can take long: a renewal of a lease that expired and is not yet revoked waits for
its revocation (revocations go through raft, rate-limited), and a follower forwards every
renewal to the leader. Renewals queued behind each other on shared streams then lapse
leases that were renewed in time (a fleet of 100,000 ranks on etcd did so). So each renewal
holds a stream of its own for its write and its answer, taken from the member's idle streams
(opened when none is idle, at most ``MOST_STREAMS`` at once; past that a renewal waits for
one within its deadline), and gives it back after the answer.

A renewal waits at most its ``seconds`` (``TimeoutError``). A stream whose renewal failed or
ran out of time is cancelled (its answer may still come), and so are the member's idle
streams when one fails (they share its channel); the caller's failover (``etcd_cluster``)
tries the next member within the same deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc  # type: ignore[import-untyped]
from aetcd import rpc

MOST_STREAMS = 128


@dataclass(frozen=True, slots=True)
class Renewed:
    """etcd's answer: the lease's TTL now (0: etcd no longer has it), the store revision of
    the member that answered, read just before the renewal, and its raft term."""

    ttl: int
    revision: int
    term: int = 0


class KeepAlives:
    """The renewal streams of one member's channel (``client``)."""

    def __init__(self, client: aetcd.Client, most: int = MOST_STREAMS) -> None:
        self._client = client
        self._idle: list[Any] = []
        self._slots = asyncio.Semaphore(most)
        self.opened = 0

    async def renew(self, lease_id: int, seconds: float) -> Renewed:
        async with asyncio.timeout(seconds), self._slots:
            if self._idle:
                stream = self._idle.pop()
            else:
                stream = self._client.leasestub.LeaseKeepAlive()
                self.opened += 1
            try:
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await stream.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("etcd ended the lease keep-alive stream")
                if int(reply.ID) != lease_id:
                    raise ConnectionError(f"etcd answered lease {reply.ID} for {lease_id}")
            except BaseException as exc:
                stream.cancel()
                if not isinstance(exc, asyncio.CancelledError | TimeoutError):
                    self.close()  # the others share its channel: open fresh ones
                if isinstance(exc, Exception) and not isinstance(
                    exc, rpc.AioRpcError | OSError | TimeoutError
                ):  # the call ended under a write (its channel closed, say)
                    raise ConnectionError(f"the lease keep-alive call ended: {exc!r}") from exc
                raise
            self._idle.append(stream)
            header = reply.header
            return Renewed(int(reply.TTL), int(header.revision), int(header.raft_term))

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for stream in idle:
            stream.cancel()
