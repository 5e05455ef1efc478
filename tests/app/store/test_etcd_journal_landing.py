"""The renewals waiting for a journal write (``app.store.etcd.journal.Journal.revision_after``,
``Landing``): all woken with the write's revision, with one deadline timer for the write,
not one a renewal; failed together, each with its own ``Unavailable``, when the write fails
or never comes. The journal's write itself (``_put``, an etcd Put) replaced by a stand-in:
no etcd here, the waiting is what is tested."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = pytest.mark.unit
pytest.importorskip("aetcd", reason="the etcd extra is not installed")

from app.store import Unavailable  # noqa: E402
from app.store.etcd.journal import TICK_S, Journal  # noqa: E402
from app.store.lease_clock import now  # noqa: E402

RENEWALS = 100


def journal() -> Journal:
    async def call(*_: Any) -> Any:
        raise AssertionError("no etcd call here")

    return Journal(call, b"", 10, 60.0, lambda _: None, lambda _: None, lambda: None)


def counting_timers(loop: asyncio.AbstractEventLoop) -> list[float]:
    """The delays of the timers ``loop.call_later`` sets from now on."""
    delays: list[float] = []
    call_later = loop.call_later

    def counted(delay: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        delays.append(delay)
        return call_later(delay, *args, **kwargs)

    loop.call_later = counted  # type: ignore[method-assign,assignment]
    return delays


def test_renewals_waiting_for_one_write_share_its_deadline_timer() -> None:
    async def main() -> None:
        j = journal()
        timers = counting_timers(asyncio.get_running_loop())
        arrived = now()
        waits = [asyncio.ensure_future(j.revision_after(arrived, 1.0)) for _ in range(RENEWALS)]
        await asyncio.sleep(0)

        async def put(value: bytes) -> int:
            return 42

        j._put = put  # type: ignore[method-assign]
        await j._write()
        assert await asyncio.gather(*waits) == [42] * RENEWALS
        assert len(timers) == 1  # 34b1f1b: one a renewal (its wait_for)
        assert await j.revision_after(arrived, 1.0) == 42  # landed after it arrived: at once

    asyncio.run(main())


def test_renewals_fail_together_when_the_write_fails_or_never_comes() -> None:
    async def main() -> None:
        j = journal()
        waits = [asyncio.ensure_future(j.revision_after(now(), 1.0)) for _ in range(4)]
        await asyncio.sleep(0)

        async def refused(value: bytes) -> int:
            raise ConnectionError("etcd refused")

        j._put = refused  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            await j._write()
        failed = await asyncio.gather(*waits, return_exceptions=True)
        assert all(isinstance(e, Unavailable) and "write failed" in str(e) for e in failed)
        assert len({id(e) for e in failed}) == 4  # each its own

        began = asyncio.get_running_loop().time()
        cancelled = asyncio.ensure_future(j.revision_after(now(), 0.2))
        waits = [asyncio.ensure_future(j.revision_after(now(), 0.2)) for _ in range(3)]
        await asyncio.sleep(0)
        cancelled.cancel()  # one renewal gone: the others still wait, then fail
        failed = await asyncio.gather(*waits, return_exceptions=True)
        waited = asyncio.get_running_loop().time() - began
        assert all(isinstance(e, Unavailable) and "wrote nothing" in str(e) for e in failed)
        assert TICK_S + 0.2 <= waited < TICK_S + 0.2 + 1.0

        later = asyncio.ensure_future(j.revision_after(now(), 0.2))  # after that deadline
        await asyncio.sleep(0)

        async def put(value: bytes) -> int:
            return 43

        j._put = put  # type: ignore[method-assign]
        await j._write()
        assert await later == 43

    asyncio.run(main())
