"""``run_inline``: a keep-alive renewal run on the protocol's stack until it first waits.

A coroutine that never waits ends inline (no task); one that waits goes on as a task from
where it stopped, in the given context, its result, its exception or its cancellation as a
task's would be.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from app.server.bypass.inline import Waiting, run_inline

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("mark", default="-")


async def at_once(value: int) -> int:
    MARK.set("set inline")
    return value


async def after(gate: asyncio.Future[int], seen: list[str]) -> int:
    MARK.set("before the wait")
    got = await gate
    seen.append(MARK.get())
    await asyncio.sleep(0)  # a bare yield, then a second wait
    return got + 1


def test_a_coroutine_that_never_waits_ends_inline_in_its_context() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        tasks = len(asyncio.all_tasks())
        assert run_inline(at_once(7), context, loop) == 7
        assert len(asyncio.all_tasks()) == tasks  # no task made
        assert context[MARK] == "set inline"
        assert MARK.get() == "-"  # the caller's context is untouched

    asyncio.run(main())


def test_one_that_waits_goes_on_as_a_task_in_the_same_context() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        seen: list[str] = []
        got = run_inline(after(gate, seen), contextvars.copy_context(), loop)
        assert isinstance(got, Waiting)
        assert not got.task.done()
        gate.set_result(41)
        assert await asyncio.wait_for(got.task, 5) == 42
        assert seen == ["before the wait"]

    asyncio.run(main())


def test_its_exception_and_its_cancellation_are_a_tasks() -> None:
    async def fails_after(gate: asyncio.Future[None]) -> int:
        await gate
        raise LookupError("after the wait")

    async def fails_at_once() -> int:
        raise KeyError("at once")

    cleaned: list[str] = []

    async def cancelled(gate: asyncio.Future[None]) -> int:
        try:
            await gate
        finally:
            cleaned.append("finally ran")
        return 0

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(KeyError):
            run_inline(fails_at_once(), contextvars.copy_context(), loop)
        gate: asyncio.Future[None] = loop.create_future()
        failing = run_inline(fails_after(gate), contextvars.copy_context(), loop)
        assert isinstance(failing, Waiting)
        gate.set_result(None)
        with pytest.raises(LookupError):
            await asyncio.wait_for(failing.task, 5)
        held: asyncio.Future[None] = loop.create_future()
        waiting = run_inline(cancelled(held), contextvars.copy_context(), loop)
        assert isinstance(waiting, Waiting)
        await asyncio.sleep(0)
        waiting.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting.task
        assert cleaned == ["finally ran"]
        assert held.cancelled()  # the wait itself was cancelled, as a task's is

    asyncio.run(main())
