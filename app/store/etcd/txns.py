"""Transactions sent together: the transactions a replica has ready while its earlier ones are
in flight go to etcd as one Txn that nests each of them (etcd 3.3 on), group commit as
databases do it. etcd applies each nested transaction's compares to the state before the whole
Txn, so only transactions that touch disjoint keys share one: each transaction's scopes (the
first two segments of every key it compares, writes or deletes, e.g. ``groups/{gid}``) must not
meet another's in the same Txn, and one that does waits for the next. Each keeps its own
outcome: won or lost by its own compares, at the shared Txn's revision.

Why: a fleet's launch on a 3-member etcd wrote a Txn per open and per registration, each with
per-request work beside its payload (gRPC on both ends, a Raft entry on each member). Shared,
100,000 ranks (W 150 s, Intel Xeon 2 cores) sent 1,149 Txns, not 25,000: ready in 32.3 s, not
43.0; etcd's CPU 22.1 s, not 33.0; this process's 24.5 s, not 32.3.

Bounds: ``PIPES`` shared Txns in flight (one: the Txns grow while one is out; at 100,000 ranks
ready in 32.9 s with one, 40.6 with two, 56.7 with four), ``MAX_TXNS`` transactions and
``MAX_BYTES`` bytes a Txn (below etcd's default ``--max-request-bytes``, 1.5 MiB), their ops
within etcd's ``--max-txn-ops``; a transaction larger than a quarter of that, or whose keys
have no scope, goes alone (so does one that finds nothing in flight). A Txn etcd refuses as a
whole (a lease one of them names is gone, the request too large for this etcd) is sent again
as its transactions one by one, each answered as if it had been sent alone; a Txn that etcd
did not answer fails every transaction in it (:class:`Unavailable`, as a lone one would). A
transaction waits at most the store's timeout for its turn, so no caller waits longer than
twice it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aetcd
from aetcd import rpc

from app.store.base import TxnResult, Unavailable

Alone = Callable[[rpc.TxnRequest], Awaitable[TxnResult]]
Call = Callable[[str, Callable[[aetcd.Client, float], Awaitable[object]]], Awaitable[object]]

PIPES = 1
# etcd's --max-txn-ops (128 by default) bounds a Txn's ops and, for a nested transaction,
# its ops plus the Txn's: a shared Txn keeps the two within it.
MAX_OPS = 128
MAX_TXNS = 32
MAX_BYTES = 1024 * 1024
_SPLIT = object()  # the Txn was refused as a whole: send its transactions one by one


def scopes(keys: Iterable[str], prefixes: Iterable[str]) -> frozenset[str] | None:
    """The scopes a transaction touches (``kind/name`` of each key, each prefix deleted), or
    None when a key has no such scope (a bare key, a prefix shorter than two whole
    segments): such a transaction goes alone."""
    out: set[str] = set()
    for key in keys:
        first, sep, rest = key.partition("/")
        if not sep or not rest:
            return None
        out.add(f"{first}/{rest.split('/', 1)[0]}")
    for prefix in prefixes:
        parts = prefix.split("/")
        if len(parts) < 3:  # "kind/name/" at least: "kind/na" would match other names
            return None
        out.add(f"{parts[0]}/{parts[1]}")
    return frozenset(out)


@dataclass
class _Batch:
    items: list[tuple[rpc.TxnRequest, asyncio.Future[TxnResult]]] = field(default_factory=list)
    scopes: set[str] = field(default_factory=set)
    size: int = 0
    widest: int = 0  # the most ops of one of its transactions
    since: float = field(default_factory=time.monotonic)

    def takes(self, touched: frozenset[str], size: int, ops: int) -> bool:
        return (
            len(self.items) < MAX_TXNS
            and len(self.items) + 1 + max(self.widest, ops) <= MAX_OPS
            and self.size + size <= MAX_BYTES
            and self.scopes.isdisjoint(touched)
        )


class TxnBatcher:
    """One a store: ``submit`` a transaction, get its own outcome."""

    def __init__(self, call: Call, alone: Alone, timeout_s: float, pipes: int = PIPES) -> None:
        self._call = call
        self._alone = alone
        self._timeout_s = timeout_s
        self._pipes = pipes
        self._in_flight = 0
        self._waiting: list[_Batch] = []
        self._kicked = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, request: rpc.TxnRequest, touched: frozenset[str] | None) -> TxnResult:
        size = request.ByteSize()
        if touched is None or size > MAX_BYTES // 4:
            return await self._alone(request)
        ops = max(len(request.compare), len(request.success))
        future: asyncio.Future[TxnResult] = asyncio.get_running_loop().create_future()
        for batch in self._waiting:
            if batch.takes(touched, size, ops):
                break
        else:
            batch = _Batch()
            self._waiting.append(batch)
        batch.items.append((request, future))
        batch.scopes |= touched
        batch.size += size
        batch.widest = max(batch.widest, ops)
        self._kick()
        return await future

    def _kick(self) -> None:
        if not self._kicked:
            self._kicked = True  # the transactions of this turn of the loop join the batch
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._kicked = False
        while self._waiting and self._in_flight < self._pipes:
            batch = self._waiting.pop(0)
            waited = time.monotonic() - batch.since
            if waited > self._timeout_s:
                self._fail(batch, self._queued(waited))
                continue
            self._in_flight += 1
            task = asyncio.ensure_future(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _queued(self, waited: float) -> Unavailable:
        return Unavailable(
            f"A transaction waited {waited:.1f} s for one of the {self._pipes} shared "
            "transactions this replica keeps in flight to etcd: etcd is not keeping up. Check "
            "etcd's disk and CPU, and that a majority of its members is up."
        )

    async def _send(self, batch: _Batch) -> None:
        try:
            if len(batch.items) == 1:
                request, future = batch.items[0]
                _settle(future, await self._alone(request))
                return
            outcomes = await self._together(batch)
            if outcomes is None:  # refused as a whole: each on its own
                await asyncio.gather(*(self._one(r, f) for r, f in batch.items))
                return
            for (_, future), outcome in zip(batch.items, outcomes, strict=True):
                _settle(future, outcome)
        except Exception as exc:  # every caller of the batch hears of it
            self._fail(batch, exc)
        except BaseException:  # cancelled (the store closing): so are its callers
            for _, future in batch.items:
                future.cancel()
            raise
        finally:
            self._in_flight -= 1
            if self._waiting:
                self._kick()

    async def _together(self, batch: _Batch) -> list[TxnResult] | None:
        request = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=r) for r, _ in batch.items])

        async def fn(client: aetcd.Client, seconds: float) -> object:
            try:
                return await client.kvstub.Txn(request, timeout=seconds)
            except rpc.AioRpcError as exc:
                if exc.code() in _SPLIT_CODES:
                    return _SPLIT
                raise

        reply = await self._call("transaction", fn)
        if reply is _SPLIT:
            return None
        revision = int(reply.header.revision)  # type: ignore[attr-defined]
        return [
            TxnResult(bool(response.response_txn.succeeded), revision)
            for response in reply.responses  # type: ignore[attr-defined]
        ]

    async def _one(self, request: rpc.TxnRequest, future: asyncio.Future[TxnResult]) -> None:
        try:
            _settle(future, await self._alone(request))
        except Exception as exc:  # its own caller hears of it
            if not future.done():
                future.set_exception(exc)

    @staticmethod
    def _fail(batch: _Batch, exc: Exception) -> None:
        for _, future in batch.items:
            if not future.done():
                future.set_exception(exc)


# NOT_FOUND: a Put named a lease that is gone; INVALID_ARGUMENT: too large, or keys etcd
# found overlapping; RESOURCE_EXHAUSTED: over gRPC's message bound.
_SPLIT_CODES = (
    rpc.StatusCode.NOT_FOUND,
    rpc.StatusCode.INVALID_ARGUMENT,
    rpc.StatusCode.RESOURCE_EXHAUSTED,
)


def _settle(future: asyncio.Future[TxnResult], outcome: TxnResult) -> None:
    if not future.done():
        future.set_result(outcome)
