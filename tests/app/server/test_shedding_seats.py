"""The shedder's seats (app/server/shedding.py): reads that can wait are answered
``REGISTRY_SHED_IN_FLIGHT`` at a time; the rest wait for a seat in arrival order, at most
``REGISTRY_SHED_QUEUE_S``, then are shed; a waiter that goes away gives its place up."""

from __future__ import annotations

import asyncio

import pytest

from app.server.shedding import Shedder

pytestmark = pytest.mark.unit

ROUTES = ("/status",)


def shedder(in_flight: int, queue_s: float) -> Shedder:
    return Shedder(0.0, in_flight, 1, ROUTES, queue_s)


def test_reads_past_the_seats_are_served_in_arrival_order() -> None:
    async def main() -> tuple[list[str], list[str], int, int]:
        s = shedder(2, 5.0)
        order: list[str] = []
        most = 0
        release = asyncio.Event()

        async def read(name: str) -> None:
            nonlocal most
            assert await s.seat() is None
            order.append(name)
            most = max(most, s.busy)
            await release.wait()
            s.leave()

        tasks = [asyncio.create_task(read(n)) for n in "abcde"]
        for _ in range(5):
            await asyncio.sleep(0)
        seated_first = list(order)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return seated_first, order, most, s.busy

    seated_first, order, most, busy = asyncio.run(main())
    assert seated_first == ["a", "b"]  # two seats; c, d and e wait
    assert order == list("abcde")  # then in arrival order
    assert most == 2
    assert busy == 0


def test_a_read_that_waits_past_the_queue_time_is_shed_naming_both_settings() -> None:
    async def main() -> tuple[str | None, float, int]:
        s = shedder(1, 0.2)
        assert await s.seat() is None  # held for the whole test
        loop = asyncio.get_running_loop()
        began = loop.time()
        why = await s.seat()
        return why, loop.time() - began, s.busy

    why, waited, busy = asyncio.run(main())
    assert why is not None
    assert "REGISTRY_SHED_IN_FLIGHT" in why, why
    assert "REGISTRY_SHED_QUEUE_S" in why, why
    assert 0.15 <= waited < 2.0, waited
    assert busy == 1  # the shed read took no seat


def test_without_a_queue_a_read_past_the_seats_is_shed_at_once() -> None:
    async def main() -> str | None:
        s = shedder(1, 0.0)
        assert await s.seat() is None
        return await asyncio.wait_for(s.seat(), 1)

    why = asyncio.run(main())
    assert why is not None
    assert "REGISTRY_SHED_IN_FLIGHT" in why, why


def test_a_waiter_that_goes_away_gives_its_place_to_the_next() -> None:
    async def main() -> tuple[list[str], int]:
        s = shedder(1, 5.0)
        assert await s.seat() is None
        got: list[str] = []

        async def read(name: str) -> None:
            if await s.seat() is None:
                got.append(name)
                s.leave()

        gone = asyncio.create_task(read("gone"))
        stays = asyncio.create_task(read("stays"))
        await asyncio.sleep(0.05)
        gone.cancel()  # its client disconnected while it waited
        await asyncio.sleep(0.05)
        s.leave()  # the first read ends: its seat passes to "stays", not to "gone"
        await asyncio.wait_for(stays, 5)
        with pytest.raises(asyncio.CancelledError):
            await gone
        return got, s.busy

    got, busy = asyncio.run(main())
    assert got == ["stays"], got
    assert busy == 0


def test_no_cap_seats_every_read() -> None:
    async def main() -> int:
        s = shedder(0, 0.0)
        for _ in range(100):
            assert await s.seat() is None
        return s.busy

    assert asyncio.run(main()) == 100
