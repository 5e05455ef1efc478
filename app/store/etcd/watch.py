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
import functools
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
    stream = await call("watch", functools.partial(_open_stream, create))
    inbox = inbox or Inbox(QUEUE_LIMIT)
    ask = PROGRESS_REQUEST
    put_fence = rpc.PutRequest(key=fence, value=b"")
    tasks = [
        asyncio.create_task(_pump(stream, inbox)),
        asyncio.create_task(_forward_nudges(nudge, inbox)),
    ]
    loop = asyncio.get_running_loop()
    proof = _Proof(start_revision, progress_s, fence_grace_s)
    try:
        while True:
            try:
                item = await asyncio.wait_for(inbox.get(), proof.wait_s(loop.time()))
            except TimeoutError:
                step = proof.quiet()
                if step == _ASK:
                    await stream.write(ask)
                elif step == _FENCE:
                    fencing = _write_fence(call, put_fence, inbox)
                    tasks[2:] = [asyncio.create_task(fencing)]  # the one before is done
                continue
            if item is _NUDGED:
                if proof.nudged():
                    await stream.write(ask)
                continue
            for batch in proof.take(item, loop.time(), len(root), prefix):
                yield batch
            if proof.settle():
                await stream.write(ask)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        stream.cancel()


async def _open_stream(create: Any, client: aetcd.Client, seconds: float) -> Any:
    """A Watch stream of ``client``'s, created with ``create``, or what refused it."""
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


async def _pump(stream: Any, inbox: Inbox) -> None:
    """gRPC's responses into the inbox, in order (waiting for room), then EOF or the error."""
    try:
        while True:
            response = await stream.read()
            await inbox.put(response)
            if response is grpc.aio.EOF:
                return
    except Exception as exc:  # the stream broke: the reader raises it
        await inbox.put(exc)


async def _forward_nudges(nudge: asyncio.Event | None, inbox: Inbox) -> None:
    while nudge is not None:
        await nudge.wait()
        nudge.clear()
        inbox.nudge()


async def _write_fence(call: Call, put_fence: Any, inbox: Inbox) -> None:
    """Write the fence; its revision (or why not) goes to the inbox as a note."""

    async def put(client: aetcd.Client, seconds: float) -> int:
        reply = await client.kvstub.Put(put_fence, timeout=seconds)
        return int(reply.header.revision)

    try:
        inbox.note(_Note(revision=await call("watch fence", put)))
    except Exception as exc:
        inbox.note(_Note(error=exc))


_ASK, _FENCE = "ask", "fence"  # what a quiet stream does next (``_Proof.quiet``)


class _Proof:
    """What ``follow`` knows of the stream's progress (module doc): every change up to
    ``delivered`` yielded; a progress request unanswered (``asked``); etcd's revision as an
    answer told it, not yet proven (``hint``, at ``hint_at``); a fence being written
    (``fencing``) or written at ``fenced`` and not yet delivered; a nudge that came while a
    check was under way (``again``)."""

    def __init__(self, start_revision: int, progress_s: float, fence_grace_s: float) -> None:
        self.progress_s = progress_s
        self.fence_grace_s = fence_grace_s
        self.delivered = start_revision - 1
        self.asked = False
        self.hint = 0
        self.hint_at = 0.0
        self.fencing = False
        self.fenced = 0
        self.again = False

    def _checking(self) -> bool:
        return bool(self.asked or self.hint or self.fencing or self.fenced)

    def _hint_waits(self) -> bool:
        return bool(self.hint and not self.fencing and not self.fenced)

    def wait_s(self, now: float) -> float:
        """How long to wait for the next item: a hint's grace, else ``progress_s``."""
        if self._hint_waits():
            return max(0.0, self.hint_at + self.fence_grace_s - now)
        return self.progress_s

    def quiet(self) -> str | None:
        """Nothing came in time: ``_ASK`` for progress, ``_FENCE`` (write one), or None
        (the fence's write has its own deadline); a fence not delivered raises."""
        if self._hint_waits():
            pass  # no event reached the hint in time: prove it with a fence
        elif self.fenced:
            raise Unavailable(
                f"etcd's watch did not deliver the fence written at revision {self.fenced} "
                f"within {self.progress_s:g} s"
            )
        elif self.fencing:
            return None
        elif self.asked:  # no answer (etcd issue 17507, or a stuck member): fence
            self.asked = False
        else:  # quiet for progress_s: ask
            self.asked = True
            return _ASK
        self.fencing = True
        self.hint = 0
        return _FENCE

    def nudged(self) -> bool:
        """A reader waits for a revision: True to ask for progress now."""
        if self._checking():
            self.again = True
            return False
        self.asked = True
        return True

    def take(self, item: Any, now: float, cut: int, prefix: str) -> list[ChangeBatch]:
        """What one item of the inbox yields (a fence's note, a response, an error)."""
        if isinstance(item, _Note):
            self.fencing = False
            if item.error is not None:
                raise Unavailable(
                    f"etcd's watch could not write its progress fence: {item.error}"
                ) from item.error
            if item.revision > self.delivered:
                self.fenced = item.revision
            return []  # a check may be done: see settle
        if isinstance(item, Exception):
            raise Unavailable(f"etcd's watch stream broke: {item!r}") from item
        if item is grpc.aio.EOF:
            raise Unavailable("etcd ended the watch stream")
        if item.compact_revision:
            raise Compacted(int(item.compact_revision))
        if item.canceled:
            raise Unavailable(f"etcd cancelled the watch: {item.cancel_reason}")
        if not item.events:  # an answer to a progress request: a hint
            self.asked = False
            revision = int(item.header.revision)
            if revision > self.delivered and revision > self.hint:
                self.hint, self.hint_at = revision, now
            elif not self.hint and not self.fencing and not self.fenced:
                return [ChangeBatch(self.delivered, ())]  # alive, and nothing to prove
            return []
        batches = _batches(item.events, cut, prefix)
        if batches:
            self.delivered = batches[-1].revision
        return batches

    def settle(self) -> bool:
        """After an item: drop what the stream proved; True to ask for a nudge that waited."""
        if self.hint and self.delivered >= self.hint:
            self.hint = 0
        if self.fenced and self.delivered >= self.fenced:
            self.fenced = 0
        if self.again and not self._checking():
            self.again = False
            self.asked = True
            return True
        return False


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
