"""``Store.changes`` on etcd: one Watch stream of etcd's own (its revisions, its history),
with progress asked for explicitly (``WatchProgressRequest``, etcd 3.4+) every
``progress_s`` while nothing changes, so that a quiet prefix still proves the stream alive and
advances the revision. A stream that breaks, or answers no progress request within
``progress_s`` more, raises :class:`Unavailable` (the caller opens it again after its last
revision, possibly through another member); a start before etcd's compaction raises
:class:`Compacted` with etcd's ``compact_revision``.
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


async def follow(
    call: Call,
    root: bytes,
    prefix: str,
    start_revision: int,
    progress_s: float,
    nudge: asyncio.Event | None = None,
) -> AsyncIterator[ChangeBatch]:
    key = root + prefix.encode()
    create = rpc.WatchRequest(
        create_request=rpc.WatchCreateRequest(
            key=key, range_end=prefix_range_end(key), start_revision=start_revision
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
    responses: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        try:
            while True:
                response = await stream.read()
                await responses.put(response)
                if response is grpc.aio.EOF:
                    return
        except Exception as exc:  # the stream broke: the reader raises it
            await responses.put(exc)

    async def nudged() -> None:
        while nudge is not None:
            await nudge.wait()
            nudge.clear()
            await responses.put(None)

    reader = asyncio.create_task(pump())
    asker = asyncio.create_task(nudged())
    asked = False
    try:
        while True:
            try:
                response = await asyncio.wait_for(responses.get(), progress_s)
            except TimeoutError:
                if asked:
                    raise Unavailable(
                        f"etcd's watch answered no progress request within {progress_s:g} s"
                    ) from None
                response = None
            if response is None:  # quiet for progress_s, or nudged: ask for progress
                if not asked:
                    await stream.write(
                        rpc.WatchRequest(progress_request=rpc.WatchProgressRequest())
                    )
                    asked = True
                continue
            if isinstance(response, Exception):
                raise Unavailable(f"etcd's watch stream broke: {response!r}") from response
            if response is grpc.aio.EOF:
                raise Unavailable("etcd ended the watch stream")
            if response.compact_revision:
                raise Compacted(int(response.compact_revision))
            if response.canceled:
                raise Unavailable(f"etcd cancelled the watch: {response.cancel_reason}")
            if not response.events:
                asked = False
                yield ChangeBatch(int(response.header.revision), ())
                continue
            for batch in _batches(response.events, len(root)):
                yield batch
    finally:
        for task in (reader, asker):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        stream.cancel()


def _batches(events: Any, cut: int) -> list[ChangeBatch]:
    """Events of one response, grouped by revision (a response may span several)."""
    out: list[ChangeBatch] = []
    revision = 0
    changes: list[KeyChange] = []
    for event in events:
        kv = event.kv
        at = int(kv.mod_revision)
        if at != revision and changes:
            out.append(ChangeBatch(revision, tuple(changes)))
            changes = []
        revision = at
        key = bytes(kv.key)[cut:].decode()
        if event.type == _DELETE:
            changes.append(KeyChange(key, None))
        else:
            changes.append(KeyChange(key, Entry(key, bytes(kv.value), at, kv.lease or None)))
    if changes:
        out.append(ChangeBatch(revision, tuple(changes)))
    return out
