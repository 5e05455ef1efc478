"""The SQLite store's bounded history of changes, for watches (``Store.changes``).

A change enters the history once it is durable (its commit settled), in revision order: a
watcher never sees what a crash could take back. Changes that fail to commit never enter
it (the store reloads the file, and their revisions are issued again). The history keeps the
last ``keep`` revisions that changed something, and at most ``keep_bytes`` of their values
(a registration's blob is megabytes: the count alone would not bound memory); a watch from
before them is told
:class:`Compacted` with the oldest revision it may start after. A restart starts an empty
history at the file's revision.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from app.store.base import ChangeBatch, Compacted, KeyChange
from app.store.sqlite.file import Change

KEEP_BYTES = 32 * 1024 * 1024  # the values the history holds, at most


class History:
    def __init__(self, keep: int = 10_000, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep = max(1, keep)
        self.keep_bytes = keep_bytes
        self.bytes = 0
        self._revisions: list[int] = []
        self._batches: list[tuple[KeyChange, ...]] = []
        self._sizes: list[int] = []
        # Changes decided in memory, waiting for their commits (in revision order).
        self._pending: deque[tuple[int, tuple[KeyChange, ...], asyncio.Future[None]]] = deque()
        self.oldest = 0  # a watch may start after this revision
        self.durable = 0  # every change up to here is durable and in the history
        self.recorded = 0  # the last revision recorded (durable or not)
        self._news: asyncio.Future[None] | None = None

    def reset(self, revision: int) -> None:
        """The store loaded its file at ``revision``: history starts after it."""
        self._revisions, self._batches, self._sizes = [], [], []
        self.bytes = 0
        self._pending.clear()
        self.oldest = self.durable = self.recorded = revision
        self._wake()

    def rewind(self, revision: int) -> None:
        """The store reloaded its file at ``revision`` after a failed commit: the revisions
        after it were never durable and are issued again, each recorded anew (else a change
        at a reissued revision would never reach a watch)."""
        self.recorded = revision

    def record(self, change: Change, fut: asyncio.Future[None]) -> None:
        """``change`` (a new revision) whose commit is ``fut``."""
        changes = tuple(
            [KeyChange(e.key, e) for e in change.puts]
            + [KeyChange(k, None) for k in change.deletes]
        )
        revision = change.revision
        self.recorded = max(self.recorded, revision)
        self._pending.append((revision, changes, fut))
        fut.add_done_callback(self._settled)

    def _settled(self, _: asyncio.Future[None]) -> None:
        moved = False
        while self._pending and self._pending[0][2].done():
            revision, changes, fut = self._pending.popleft()
            if fut.cancelled() or fut.exception() is not None:
                continue  # never durable: the store reloads and issues the revision again
            self.durable = max(self.durable, revision)
            if changes:
                size = sum(len(c.entry.value) for c in changes if c.entry is not None)
                self._revisions.append(revision)
                self._batches.append(changes)
                self._sizes.append(size)
                self.bytes += size
            moved = True
        cut = max(0, len(self._revisions) - self.keep)
        dropped = sum(self._sizes[:cut])
        while cut < len(self._revisions) - 1 and self.bytes - dropped > self.keep_bytes:
            dropped += self._sizes[cut]
            cut += 1
        if cut:
            self.oldest = self._revisions[cut - 1]
            self.bytes -= dropped
            del self._revisions[:cut]
            del self._batches[:cut]
            del self._sizes[:cut]
        if moved:
            self._wake()

    def wake(self) -> None:
        """Wake the followers (the store is closing: they stop)."""
        self._wake()

    def _wake(self) -> None:
        if self._news is not None and not self._news.done():
            self._news.set_result(None)
        self._news = None

    def since(self, revision: int) -> list[ChangeBatch]:
        """The kept batches at ``revision`` and after."""
        if revision <= self.oldest:
            raise Compacted(self.oldest + 1)
        at = bisect.bisect_left(self._revisions, revision)
        return [
            ChangeBatch(r, c) for r, c in zip(self._revisions[at:], self._batches[at:], strict=True)
        ]

    async def wait(self, timeout_s: float) -> None:
        """Until something new is durable, or ``timeout_s`` passes."""
        if self._news is None:
            self._news = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._news), timeout_s)

    async def follow(
        self, prefix: str, start_revision: int, progress_s: float, closed: Callable[[], bool]
    ) -> AsyncIterator[ChangeBatch]:
        """``Store.changes`` over this history."""
        loop = asyncio.get_running_loop()
        after = start_revision - 1  # every kept batch up to here was looked at
        told = after  # the watcher knows of every change up to here
        quiet_since = loop.time()
        while not closed():
            for batch in self.since(after + 1):
                after = batch.revision
                under = tuple(c for c in batch.changes if c.key.startswith(prefix))
                if under:
                    told = after
                    quiet_since = loop.time()
                    yield ChangeBatch(batch.revision, under)
            if self._revisions and self._revisions[-1] > after:
                continue  # kept while a batch was out with the watcher: look at it first
            # Progress: at once past changes elsewhere (a reader waiting for the feed to reach
            # the store's revision waits for that, not for the next interval), else once per
            # progress_s. No batch past ``after`` is kept, so none is skipped.
            after = max(after, self.durable)
            if after > told or loop.time() - quiet_since >= progress_s:
                told = after
                quiet_since = loop.time()
                yield ChangeBatch(after, ())
            await self.wait(max(0.0, quiet_since + progress_s - loop.time()))
