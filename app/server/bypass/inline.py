"""A coroutine run on the caller's stack until it first waits (Python 3.12's eager tasks, for
3.11): a keep-alive renewal that the store answers from memory (SQLite) ends there, with no
task, no ``call_soon`` and no loop turn of its own; one that waits (etcd's gRPC, a range read)
goes on as a task from where it stopped, in the same context, exactly as if a task had run it
from the start. Until it first waits there is no current task: code that needs one before
that (``asyncio.timeout``, as the etcd store's calls) must not run here."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Waiting(Generic[T]):
    """A coroutine that stopped at its first wait: ``task`` runs the rest."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[T]) -> None:
        self.task = task


class _Rest(Generic[T]):
    """Awaiting it resumes ``coro``: first gives its task what ``coro`` waited on (a future, or
    ``None`` for a bare yield), then drives it on (``yield from``: sends and throws pass)."""

    def __init__(self, coro: Coroutine[Any, Any, T], waited: Any) -> None:
        self.coro = coro
        self.waited = waited

    def __await__(self) -> Generator[Any, None, T]:
        coro, waited = self.coro, self.waited
        while True:
            try:
                yield waited
            except BaseException as exc:  # cancelled (or thrown into) while it waited
                try:
                    waited = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                continue
            return (yield from coro.__await__())


async def _rest(coro: Coroutine[Any, Any, T], waited: Any) -> T:
    return await _Rest(coro, waited)


def run_inline(
    coro: Coroutine[Any, Any, T], context: contextvars.Context, loop: asyncio.AbstractEventLoop
) -> T | Waiting[T]:
    """``coro``'s result when it ends without waiting, else a :class:`Waiting` whose task (on
    ``loop``, in ``context``) finishes it. An exception it raises at once is raised here."""
    try:
        waited = context.run(coro.send, None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    return Waiting(loop.create_task(_rest(coro, waited), context=context))
