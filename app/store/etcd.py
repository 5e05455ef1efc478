"""The etcd store: a thin translation of the storage interface onto an etcd v3 cluster.

Talks gRPC through ``aetcd`` (asyncio). The interface was shaped after etcd, so:

- a transaction is one etcd Txn: each compare is ``mod_revision == r``, or ``version == 0``
  for "absent"; a prefix delete is a DeleteRange with the prefix's range end;
- leases are etcd leases: they expire on the cluster's own clock, with no registry alive;
- ``range`` is one linearizable Range (never a stale answer from a member without quorum),
  plus the remaining time of the leases it saw (cached a moment, since every read of a
  group would otherwise ask once per rank);
- ``wait`` is a watch from ``after_revision + 1``, with a linearizable probe every
  ``probe_interval_s`` so that a waiter learns of a lost quorum without waiting out its time.

Every call has one deadline, ``timeout_s``, shared among the endpoints: the preferred one is
tried first and, when it fails or stalls, the next, each with a fair share of the time left.
Whatever goes wrong below surfaces as :class:`StoreUnavailable`, never as a hang.
Keys live under ``/{prefix}/``; replicas on one prefix share everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
from aetcd.utils import prefix_range_end

from app.errors import StoreUnavailable
from app.store.base import (
    Compare,
    Delete,
    Entry,
    Lease,
    Op,
    Put,
    Snapshot,
    Store,
    TxnResult,
)

T = TypeVar("T")

_MIB = 1024 * 1024
# Agent metadata blobs reach a few MiB (the API's 4 MiB body limit); gRPC's default cap on a
# message is 4 MiB. The etcd side needs --max-request-bytes raised to match (see README).
_GRPC_OPTIONS: dict[str, Any] = {
    "grpc.max_send_message_length": 16 * _MIB,
    "grpc.max_receive_message_length": 16 * _MIB,
    # A restarted member is dialed again within a second, not after gRPC's 2-minute backoff.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Notice a silently dead peer (a partition, not a refused connection) on idle channels;
    # not below etcd's --grpc-keepalive-min-time (5 s) or it closes the connection.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


# Bounds the tries of one call (the deadline bounds its time).
_MAX_TRIES = 64


def _rpc_code(exc: BaseException) -> str:
    """The gRPC status name behind an aetcd error (aetcd chains the AioRpcError as cause)."""
    cause: BaseException | None = exc
    while cause is not None:
        code = getattr(cause, "code", None)
        if callable(code):
            with contextlib.suppress(Exception):
                return str(getattr(code(), "name", code()))
        cause = cause.__cause__
    return ""


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h:p[,h:p…]/prefix`` → ([(host, port), …], prefix); the prefix defaults to
    ``engine-registry``."""
    if not url.startswith("etcd://"):
        raise ValueError(f"Not an etcd store URL: {url!r}")
    hosts, _, prefix = url[len("etcd://") :].partition("/")
    endpoints: list[tuple[str, int]] = []
    for part in filter(None, (h.strip() for h in hosts.split(","))):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"Bad etcd endpoint {part!r} in {url!r}: expected host:port, e.g. "
                "etcd://127.0.0.1:2379,127.0.0.1:22379/registry"
            )
        endpoints.append((host, int(port)))  # an IPv6 host keeps its brackets for gRPC
    if not endpoints:
        raise ValueError(f"No etcd endpoint in {url!r}: expected etcd://host:port/prefix")
    prefix = prefix.strip("/") or "engine-registry"
    return endpoints, prefix


class EtcdStore(Store):
    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = "engine-registry",
        *,
        timeout_s: float = 10.0,
        probe_interval_s: float = 1.0,
        lease_cache_s: float = 1.0,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._root = f"/{prefix.strip('/')}/".encode()
        self.description = (
            f"etcd://{','.join(f'{h}:{p}' for h, p in self.endpoints)}/{prefix.strip('/')}"
        )
        self._timeout_s = timeout_s
        self._probe_interval_s = probe_interval_s
        self._lease_cache_s = lease_cache_s
        self._clients: list[aetcd.Client | None] = [None] * len(self.endpoints)
        self._preferred = 0
        # lease id → (monotonic time read, remaining seconds then)
        self._lease_ttl: dict[int, tuple[float, float]] = {}
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 10.0) -> EtcdStore:
        endpoints, prefix = parse_url(url)
        return cls(endpoints, prefix, timeout_s=timeout_s)

    # -- plumbing ------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return self._root + key.encode()

    def _unkey(self, key: bytes) -> str:
        return key[len(self._root) :].decode()

    def _client(self, index: int) -> aetcd.Client:
        client = self._clients[index]
        if client is None:
            host, port = self.endpoints[index]
            # The client's own timeout is a backstop; _call gives each attempt its share.
            client = aetcd.Client(host, port, timeout=self._timeout_s, options=_GRPC_OPTIONS)
            self._clients[index] = client
        return client

    async def _call(self, what: str, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run ``fn`` on the preferred endpoint, failing over to the others, round after
        round, all within ``timeout_s``. A member that answers at once with an error (no
        leader yet, leader changed, connection refused) costs a try, not the deadline:
        elections last about a second, so rounds go on with a short pause until it passes.

        ``fn`` must be safe to repeat: an attempt that timed out may have been applied (a
        repeated compare-and-set then loses, and its caller re-reads)."""
        if self._closed:
            raise StoreUnavailable("The etcd store is closed (the service is shutting down).")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        n = len(self.endpoints)
        failures: list[str] = []
        start = self._preferred
        for attempt in range(_MAX_TRIES):
            if attempt and attempt % n == 0:  # every endpoint failed this round
                await asyncio.sleep(min(0.05 * (attempt // n), 0.25, deadline - loop.time()))
            # A fair share of the time left for each endpoint not yet tried this round.
            budget = (deadline - loop.time()) / (n - attempt % n)
            if budget <= 0:
                break
            index = (start + attempt) % n
            host, port = self.endpoints[index]
            try:
                return await asyncio.wait_for(fn(self._client(index)), budget)
            except TimeoutError:
                failures.append(f"{host}:{port}: no answer within {budget:.1f} s")
            except aetcd.InvalidArgumentError as exc:
                raise StoreUnavailable(
                    f"etcd refused the {what}: {exc}. If it says the request is too large, "
                    "raise etcd's --max-request-bytes above the largest agent metadata blob."
                ) from exc
            except (aetcd.ClientError, OSError) as exc:
                failures.append(f"{host}:{port}: {exc}")
            if self._preferred == index:
                self._preferred = (index + 1) % n
        raise StoreUnavailable(
            f"etcd did not answer the {what} within {self._timeout_s:g} s "
            f"({len(failures)} tries; last: {'; '.join(failures[-n:]) or 'no time left'}). "
            "Check that a majority of the etcd members is up and reachable from this replica."
        )

    def _entry(self, kv: Any) -> Entry:
        return Entry(self._unkey(kv.key), bytes(kv.value), int(kv.mod_revision), kv.lease or None)

    async def _revision(self, client: aetcd.Client) -> int:
        head = await client.get_range(self._root, self._root + b"\0")
        return int(head.header.revision)

    # -- reads -----------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        async def fn(client: aetcd.Client) -> Entry | None:
            found = await client.get(self._key(key))
            return None if found is None else self._entry(found)

        return await self._call("read", fn)

    async def range(self, prefix: str) -> Snapshot:
        start = self._key(prefix)

        async def fn(client: aetcd.Client) -> Snapshot:
            found = await client.get_range(start, prefix_range_end(start))
            entries = [self._entry(kv) for kv in found.kvs]
            leases = {e.lease for e in entries if e.lease is not None}
            return Snapshot(
                entries, int(found.header.revision), await self._remaining(client, leases)
            )

        return await self._call("read", fn)

    async def _remaining(self, client: aetcd.Client, leases: set[int]) -> dict[int, float]:
        now = time.monotonic()
        out: dict[int, float] = {}
        ask: list[int] = []
        for lease in leases:
            cached = self._lease_ttl.get(lease)
            if cached is not None and now - cached[0] < self._lease_cache_s:
                out[lease] = max(0.0, cached[1] - (now - cached[0]))
            else:
                ask.append(lease)
        infos = await asyncio.gather(*(client.get_lease_info(lease, keys=False) for lease in ask))
        for lease, info in zip(ask, infos, strict=True):
            out[lease] = max(0.0, float(info.TTL))
            self._remember(lease, out[lease])
        return out

    def _remember(self, lease: int, remaining: float | None) -> None:
        if remaining is None:
            self._lease_ttl.pop(lease, None)
            return
        if len(self._lease_ttl) > 10_000:  # bounded: drop what is stale anyway
            horizon = time.monotonic() - self._lease_cache_s
            self._lease_ttl = {k: v for k, v in self._lease_ttl.items() if v[0] > horizon}
        self._lease_ttl[lease] = (time.monotonic(), remaining)

    # -- writes ----------------------------------------------------------------------------

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        async def fn(client: aetcd.Client) -> TxnResult:
            t = client.transactions
            checks = [
                t.version(self._key(c.key)) == 0
                if c.mod_revision == 0
                else t.mod(self._key(c.key)) == c.mod_revision
                for c in compares
            ]
            requests = []
            for op in ops:
                key = self._key(op.key)
                if isinstance(op, Put):
                    requests.append(t.put(key, op.value, lease=op.lease or 0))
                elif isinstance(op, Delete) and op.prefix:
                    requests.append(t.delete(key, range_end=prefix_range_end(key)))
                else:
                    requests.append(t.delete(key))
            try:
                succeeded, responses = await client.transaction(checks, requests, [])
            except aetcd.ClientError as exc:
                if _rpc_code(exc) != "NOT_FOUND":  # a Put named a lease that is gone
                    raise
                return TxnResult(False, await self._revision(client))
            # Every operation of a Txn happens at one revision, which each response carries.
            revisions = [
                int(getattr(r, r.WhichOneof("response")).header.revision) for r in responses
            ]
            if succeeded and revisions:
                return TxnResult(True, max(revisions))
            return TxnResult(bool(succeeded), await self._revision(client))

        return await self._call("transaction", fn)

    async def grant_lease(self, ttl_s: int) -> Lease:
        async def fn(client: aetcd.Client) -> Lease:
            granted = await client.lease(ttl_s)
            return Lease(int(granted.id), int(granted.ttl), float(granted.ttl))

        lease = await self._call("lease grant", fn)
        self._remember(lease.id, lease.remaining_s)
        return lease

    async def refresh_lease(self, lease_id: int) -> Lease | None:
        async def fn(client: aetcd.Client) -> Lease | None:
            reply = await client.refresh_lease(lease_id)
            if reply is None or reply.TTL <= 0:
                return None
            return Lease(lease_id, int(reply.TTL), float(reply.TTL))

        lease = await self._call("lease refresh", fn)
        self._remember(lease_id, None if lease is None else lease.remaining_s)
        return lease

    async def revoke_lease(self, lease_id: int) -> None:
        async def fn(client: aetcd.Client) -> None:
            try:
                await client.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                if _rpc_code(exc) != "NOT_FOUND":
                    raise

        await self._call("lease revoke", fn)
        self._remember(lease_id, None)

    # -- waiting ---------------------------------------------------------------------------

    async def wait(self, prefix: str, after_revision: int, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        start = self._key(prefix)
        end = prefix_range_end(start)

        async def open_watch(client: aetcd.Client) -> aetcd.Watch | None:
            try:
                return await client.watch(start, range_end=end, start_revision=after_revision + 1)
            except aetcd.RevisionCompactedError:
                return None  # history is gone: report a change, the caller re-reads

        watch = await self._call("watch", open_watch)
        if watch is None:
            return True
        watching = watch

        async def first_event() -> None:
            async for _ in watching:
                return

        task = asyncio.create_task(first_event())
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                done, _ = await asyncio.wait({task}, timeout=min(remaining, self._probe_interval_s))
                if done:
                    if task.exception() is not None:
                        # The stream broke (a member died): say "changed" so the caller
                        # re-reads through failover and waits again on a fresh watch.
                        await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
                    return True
                if deadline - loop.time() <= 0:
                    return False  # never probe past the caller's deadline
                # Linearizable probe: raises StoreUnavailable when the cluster lost quorum,
                # and sees changes a watch on a cut-off member would never deliver.
                probe = await self._call("read", lambda c: c.get_range(start, end))
                if any(int(kv.mod_revision) > after_revision for kv in probe.kvs):
                    return True
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)

    # -- lifecycle -------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._call("read", self._revision)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        clients = [c for c in self._clients if c is not None]
        self._clients = [None] * len(self.endpoints)
        for client in clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 2.0)
