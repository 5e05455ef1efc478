"""``Store.changes`` on etcd: one Watch stream of etcd's own (its revisions, its history).

**Progress is proven by the stream's own events, never by a progress notification alone.**
etcd up to 3.4.24 and 3.5.7 (3.4.23 is Debian's, which the project ships and tests) answers a
requested progress notification (``WatchProgressRequest``) out of band of the watch's events
(etcd issue 15220): its revision can arrive while events up to it are still on their way, most
of all right after a watch starts behind etcd's head. Taken as progress, it let a list or a
watch start past changes the feed had not applied yet, and miss them for good. Events of one
watcher always arrive in revision order, so here:

- an answer to a progress request is a hint of etcd's revision ``R``; it is progress only once
  the stream has delivered an event at ``R`` or later;
- when no event reaches ``R`` within ``FENCE_GRACE_S`` (``R`` came from changes outside the
  prefix, say), the stream writes a *fence*: an empty value under the key just before the
  prefix (``groups.`` for ``groups/``), which the watch's range covers and no read of the
  prefix does. Its event, on the same watcher, proves every change before it delivered, and is
  reported as progress (an empty batch), never as a change. Every replica's fences use the one
  key, and each proves progress to every replica's stream.

A request for progress is sent every ``progress_s`` while the stream is quiet, and soon after
``nudge`` is set (a reader waits for a revision). A request unanswered for ``progress_s`` is
followed by a fence (etcd 3.4.25-3.4.30 and 3.5.8-3.5.12 answer none on a new watch until an
event comes: etcd issue 17507); a fence not delivered within ``progress_s`` more, or a stream
that breaks, raises :class:`Unavailable` (the caller opens it again after its last revision,
possibly through another member); a start before etcd's compaction raises :class:`Compacted`
with etcd's ``compact_revision``.

Responses wait for the reader in a bounded queue (``QUEUE_LIMIT``): a reader that lags stops
the stream's reads, and gRPC's flow control holds etcd back, instead of this process's memory
growing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aetcd
import grpc  # type: ignore[import-untyped]
from aetcd import rpc
from aetcd.utils import prefix_range_end

from app.store.base import ChangeBatch, Compacted, Entry, KeyChange, Unavailable

Call = Callable[[str, Callable[[aetcd.Client, float], Awaitable[Any]]], Awaitable[Any]]
_DELETE = 1  # mvccpb.Event.DELETE
# Responses read from gRPC and not yet taken by the reader. At 100,000 ranks a response is
# mostly one node's registration (8 agent records, about 12 KiB): 64 of them is under 1 MiB.
QUEUE_LIMIT = 64
# How long an answer to a progress request waits for the stream's events to reach its
# revision before a fence is written to prove it.
FENCE_GRACE_S = 0.05
PROGRESS_REQUEST = rpc.WatchRequest(progress_request=rpc.WatchProgressRequest())


class _Note:
    """What the stream's own tasks tell the reader: a nudge, a fence written (its revision), a
    fence that could not be written (the error)."""

    __slots__ = ("error", "revision")

    def __init__(self, revision: int = 0, error: Exception | None = None) -> None:
        self.revision = revision
        self.error = error


_NUDGED = _Note()


class Inbox:
    """What the reader takes, in order: gRPC's responses, at most ``limit`` waiting (``put``
    waits for room), and notes, which never wait and are never dropped (a nudge waits as one,
    however many came). ``peak``: the most responses that waited at once."""

    def __init__(self, limit: int) -> None:
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._room = asyncio.Semaphore(limit)
        self._nudged = False
        self.waiting = 0
        self.peak = 0

    async def put(self, response: Any) -> None:
        await self._room.acquire()
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        self._items.put_nowait(response)

    def note(self, note: _Note) -> None:
        self._items.put_nowait(note)

    def nudge(self) -> None:
        if not self._nudged:
            self._nudged = True
            self._items.put_nowait(_NUDGED)

    async def get(self) -> Any:
        item = await self._items.get()
        if item is _NUDGED:
            self._nudged = False
        elif not isinstance(item, _Note):
            self.waiting -= 1
            self._room.release()
        return item


def fence_key(key: bytes) -> bytes:
    """The key just before ``key``'s range in etcd's order (its last byte less one):
    ``…/groups.`` for ``…/groups/``. A prefix read of ``key`` never sees it."""
    if not key or key[-1] == 0:
        raise ValueError(f"a watched prefix needs a last byte above 0, not {key!r}")
    return key[:-1] + bytes([key[-1] - 1])


async def follow(
    call: Call,
    root: bytes,
    prefix: str,
    start_revision: int,
    progress_s: float,
    nudge: asyncio.Event | None = None,
    *,
    inbox: Inbox | None = None,
    fence_grace_s: float = FENCE_GRACE_S,
) -> AsyncIterator[ChangeBatch]:
    """The changes under ``prefix`` from ``start_revision`` (module docstring); ``inbox``: the
    queue of responses (default: ``QUEUE_LIMIT`` of them), given to watch its fill."""
    key = root + prefix.encode()
    fence = fence_key(key)
    create = rpc.WatchRequest(
        create_request=rpc.WatchCreateRequest(
            key=fence, range_end=prefix_range_end(key), start_revision=start_revision
        )
    )

    async def open_stream(client: aetcd.Client, seconds: float) -> Any:
        stream = rpc.WatchStub(client.channel).Watch()
        try:
            async with asyncio.timeout(seconds):
                await stream.write(create)
                first = await stream.read()
        except BaseException:
            stream.cancel()
            raise
        if first is grpc.aio.EOF:
            stream.cancel()
            raise ConnectionError("the watch stream ended before it was created")
        if first.compact_revision:
            stream.cancel()
            raise Compacted(int(first.compact_revision))
        if first.canceled:
            stream.cancel()
            raise ConnectionError(f"etcd cancelled the watch: {first.cancel_reason}")
        return stream

    stream = await call("watch", open_stream)
    inbox = inbox or Inbox(QUEUE_LIMIT)
    ask = PROGRESS_REQUEST
    put_fence = rpc.PutRequest(key=fence, value=b"")

    async def pump() -> None:
        try:
            while True:
                response = await stream.read()
                await inbox.put(response)
                if response is grpc.aio.EOF:
                    return
        except Exception as exc:  # the stream broke: the reader raises it
            await inbox.put(exc)

    async def nudged() -> None:
        while nudge is not None:
            await nudge.wait()
            nudge.clear()
            inbox.nudge()

    async def write_fence() -> None:
        async def put(client: aetcd.Client, seconds: float) -> int:
            reply = await client.kvstub.Put(put_fence, timeout=seconds)
            return int(reply.header.revision)

        try:
            inbox.note(_Note(revision=await call("watch fence", put)))
        except Exception as exc:
            inbox.note(_Note(error=exc))

    tasks = [asyncio.create_task(pump()), asyncio.create_task(nudged())]
    loop = asyncio.get_running_loop()
    delivered = start_revision - 1  # every change up to it has been yielded
    asked = False  # a progress request is unanswered
    hint = 0  # etcd's revision as a progress answer told it, not yet proven
    hint_at = 0.0
    fencing = False  # a fence is being written
    fenced = 0  # a fence written, not yet delivered
    again = False  # a nudge came while a check was under way
    try:
        while True:
            timeout = progress_s
            if hint and not fencing and not fenced:
                timeout = max(0.0, hint_at + fence_grace_s - loop.time())
            try:
                item = await asyncio.wait_for(inbox.get(), timeout)
            except TimeoutError:
                if hint and not fencing and not fenced:
                    item = None  # no event reached the hint in time: prove it with a fence
                elif fenced:
                    raise Unavailable(
                        f"etcd's watch did not deliver the fence written at revision {fenced} "
                        f"within {progress_s:g} s"
                    ) from None
                elif fencing:
                    continue  # the write has its own deadline
                elif asked:  # no answer (etcd issue 17507, or a stuck member): fence
                    asked = False
                    item = None
                else:  # quiet for progress_s: ask
                    await stream.write(ask)
                    asked = True
                    continue
                fencing = True
                hint = 0
                tasks[2:] = [asyncio.create_task(write_fence())]  # the one before is done
                continue
            if item is _NUDGED:
                if asked or hint or fencing or fenced:
                    again = True
                else:
                    await stream.write(ask)
                    asked = True
                continue
            if isinstance(item, _Note):
                fencing = False
                if item.error is not None:
                    raise Unavailable(
                        f"etcd's watch could not write its progress fence: {item.error}"
                    ) from item.error
                if item.revision > delivered:
                    fenced = item.revision
                item = None  # a check may be done: see below
            elif isinstance(item, Exception):
                raise Unavailable(f"etcd's watch stream broke: {item!r}") from item
            elif item is grpc.aio.EOF:
                raise Unavailable("etcd ended the watch stream")
            elif item.compact_revision:
                raise Compacted(int(item.compact_revision))
            elif item.canceled:
                raise Unavailable(f"etcd cancelled the watch: {item.cancel_reason}")
            elif not item.events:  # an answer to a progress request: a hint
                asked = False
                revision = int(item.header.revision)
                if revision > delivered and revision > hint:
                    hint, hint_at = revision, loop.time()
                elif not hint and not fencing and not fenced:
                    yield ChangeBatch(delivered, ())  # alive, and nothing to prove
            else:
                for batch in _batches(item.events, len(root), prefix):
                    delivered = batch.revision
                    yield batch
            if hint and delivered >= hint:
                hint = 0
            if fenced and delivered >= fenced:
                fenced = 0
            if again and not (asked or hint or fencing or fenced):
                again = False
                await stream.write(ask)
                asked = True
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        stream.cancel()


def _batches(events: Any, cut: int, prefix: str) -> list[ChangeBatch]:
    """Events of one response, grouped by revision (a response may span several); a revision
    with no change under ``prefix`` (a fence) is an empty batch: progress."""
    out: list[ChangeBatch] = []
    revision = 0
    changes: list[KeyChange] = []
    for event in events:
        kv = event.kv
        at = int(kv.mod_revision)
        if at != revision and revision:
            out.append(ChangeBatch(revision, tuple(changes)))
            changes = []
        revision = at
        key = bytes(kv.key)[cut:].decode()
        if not key.startswith(prefix):
            continue
        if event.type == _DELETE:
            changes.append(KeyChange(key, None))
        else:
            changes.append(KeyChange(key, Entry(key, bytes(kv.value), at, kv.lease or None)))
    if revision:
        out.append(ChangeBatch(revision, tuple(changes)))
    return out
