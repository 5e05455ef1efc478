"""The one thread that owns the SQLite connection, and its group commit.

Commits are gathered on the event loop during one turn of the loop and handed over once
(a hand-over wakes the thread, which then competes for the GIL: one per turn, not one per
request), through a C-level queue. The thread takes every commit waiting in the queue and
writes them in one transaction, so a storm of registrations costs one ``BEGIN IMMEDIATE``
… ``COMMIT`` per batch instead of one per request.

After a failed commit the thread fails every commit queued behind it (they were decided on
top of the failed one) until the store reloads the file (a ``call`` of ``load``), or resumes
(``resume``: what failed was only renewals, which memory still holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from app.store.base import Unavailable
from app.store.sqlite.file import Change, FileFailure, SqliteFile

T = TypeVar("T")

MAX_BATCH = 1024

_Job = tuple[str, Any, "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class FileThread:
    def __init__(self, file: SqliteFile) -> None:
        self.file = file
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._poisoned: FileFailure | None = None
        self._gathered: list[tuple[Change, asyncio.Future[None]]] = []
        self.batches = 0
        self.commits = 0
        # Called on the loop right after a batch's futures settle (the store wakes its waiters).
        self.on_settled: Callable[[list[asyncio.Future[None]]], None] | None = None

    def _submit(self, kind: str, payload: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:
            # A daemon: a store nobody closed must not hold the interpreter at exit (an
            # interrupted commit is then what a kill -9 leaves, which WAL recovers).
            self._thread = threading.Thread(target=self._work, name="sqlite-store", daemon=True)
            self._thread.start()
        self._queue.put((kind, payload, fut, loop))
        return fut

    def commit(self, change: Change) -> asyncio.Future[None]:
        """Make ``change`` durable; the future settles once it is in the file (or failed)."""
        # The loop of the commits gathered in this turn when there are some: on Python 3.11
        # asyncio.get_running_loop() is a getpid() system call each time.
        gathered = self._gathered
        loop = gathered[0][1].get_loop() if gathered else asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not gathered:
            loop.call_soon(self._hand_over)
        gathered.append((change, fut))
        return fut

    def _hand_over(self) -> None:
        gathered, self._gathered = self._gathered, []
        if gathered:
            self._submit("commit", gathered)

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` on the thread, after everything queued before it."""
        try:
            result: T = await asyncio.wait_for(asyncio.shield(self._submit("call", fn)), timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"SQLite store {self.file.path} did not answer within {timeout_s:g} s "
                "(a stalled disk, or a long queue of writes ahead)."
            ) from None
        return result

    def resume(self) -> None:
        """Take commits again (run on the thread by ``call``: after every commit before it)."""
        self._poisoned = None

    def _work(self) -> None:
        carry: _Job | None = None
        while True:
            job = carry if carry is not None else self._queue.get()
            carry = None
            if job is None:
                return
            kind, payload, fut, loop = job
            if kind == "call":
                try:
                    outcome: tuple[Any, BaseException | None] = (payload(), None)
                    if payload == self.file.load:
                        self._poisoned = None
                except BaseException as exc:  # handed to the awaiting coroutine
                    outcome = (None, exc)
                _hand(loop, fut, *outcome)
                continue
            batch = list(payload)
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None or more[0] != "commit":
                    carry = more
                    if more is None:
                        self._queue.put(None)
                        carry = None
                    break
                batch.extend(more[1])
            self._commit(batch, loop)

    def _commit(
        self, batch: list[tuple[Change, asyncio.Future[None]]], loop: asyncio.AbstractEventLoop
    ) -> None:
        error: BaseException | None = self._poisoned
        if error is None:
            try:
                self.file.commit([change for change, _ in batch])
                self.batches += 1
                self.commits += len(batch)
            except FileFailure as exc:
                self._poisoned = error = exc
            except BaseException as exc:
                self._poisoned = error = FileFailure(f"SQLite store failed: {exc!r}")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._settled, [fut for _, fut in batch], error)

    def _settled(self, futs: list[asyncio.Future[None]], exc: BaseException | None) -> None:
        _settle_all(futs, exc)
        if self.on_settled is not None:
            self.on_settled(futs)

    async def stop(self, timeout_s: float) -> None:
        if self._thread is None:
            self.file.close()
            return
        with contextlib.suppress(Unavailable, FileFailure):
            await self.call(self.file.close, timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


def _hand(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    result: Any,
    exc: BaseException | None,
) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(_settle, fut, result, exc)


def _settle_all(futs: list[asyncio.Future[None]], exc: BaseException | None) -> None:
    for fut in futs:
        _settle(fut, None, exc)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the caller gave up (timeout)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
