"""The SQLite store's lease clock (app/store/lease_clock.py) on a real file: a renewal is
judged at its request's arrival, the sweeper spares a lease a heartbeat in flight reached in
time, a stall of the event loop stops every live lease's clock (bounded by the grace), and
a restart is such a stall."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from app.store import Put, Unavailable
from app.store.lease_clock import ARRIVED, CLOCK, IN_FLIGHT, now
from app.store.sqlite.store import SqliteStore

pytestmark = [pytest.mark.store, pytest.mark.serial, pytest.mark.timeout(60)]


def _stall_the_loop(seconds: float) -> None:
    """Block the event loop, as a stopped or starved registry process is."""
    time.sleep(seconds)


async def _stall_past_expiry(store: SqliteStore, lease_id: int, left_s: float) -> None:
    """With the loop's watch running, leave the lease ``left_s`` and stall the loop past it."""
    await asyncio.sleep(0.1)  # the loop's watch is running
    store._leases[lease_id].expires_at = now() + left_s
    _stall_the_loop(CLOCK.stall_s + 0.5)


async def _store_with_lease(path: Path, ttl_s: int = 5) -> tuple[SqliteStore, int]:
    store = SqliteStore(path, sweep_interval_s=3600)  # sweeps only when the test asks
    await store.start()
    lease = await store.grant_lease(ttl_s)
    assert (await store.txn([], [Put("agent/0", b"x", lease.id)])).succeeded
    return store, lease.id


def test_a_renewal_that_arrived_before_expiry_renews(tmp_path: Path) -> None:
    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "r.db")
        try:
            arrived = now()
            store._leases[lease_id].expires_at = arrived + 0.2  # reached 0.2 s before expiry
            await asyncio.sleep(0.4)  # ... and waited past it in the registry's queue
            token = IN_FLIGHT.begin(arrived)
            try:
                assert await store.purge_expired() == 0, "purged under a heartbeat in flight"
                ARRIVED.set(arrived)
                renewed = await store.refresh_lease(lease_id)
            finally:
                IN_FLIGHT.end(token)
            assert renewed is not None, "a heartbeat that arrived in time was refused"
            ARRIVED.set(None)
            assert await store.get("agent/0") is not None
            # One that arrived after the expiry is refused, as before.
            store._leases[lease_id].expires_at = now() - 0.1
            ARRIVED.set(now())
            assert await store.refresh_lease(lease_id) is None
        finally:
            await store.close()

    asyncio.run(main())


def test_a_stall_of_the_loop_stops_the_leases_clock(tmp_path: Path) -> None:
    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "s.db")
        try:
            await _stall_past_expiry(store, lease_id, 0.5)
            assert await store.get("agent/0") is not None, "lapsed by the registry's stall"
            left = store._leases[lease_id].expires_at - now()
            assert 0.2 < left <= 0.5 + 0.05, left  # what it had left when the stall began
            assert await store.refresh_lease(lease_id) is not None
        finally:
            await store.close()

    asyncio.run(main())


def test_a_loop_that_keeps_lagging_stops_the_leases_clock(tmp_path: Path) -> None:
    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "lag.db")
        try:
            await asyncio.sleep(0.1)
            store._leases[lease_id].expires_at = now() + 1.5
            for _ in range(6):  # six callbacks of 0.35 s: no one gap is a stall, 2.1 s in all
                _stall_the_loop(0.35)
                await asyncio.sleep(0.06)  # the watch's timer runs, late
            assert await store.get("agent/0") is not None, "lapsed while the loop lagged"
        finally:
            await store.close()

    asyncio.run(main())


def test_the_grace_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CLOCK, "grace_s", 0.3)

    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "b.db")
        try:
            await _stall_past_expiry(store, lease_id, 0.2)  # past the lease left + the grace
            assert await store.get("agent/0") is None
        finally:
            await store.close()

    asyncio.run(main())


def test_a_restart_is_a_stall(tmp_path: Path) -> None:
    path = tmp_path / "restart.db"

    async def first() -> float:
        store, lease_id = await _store_with_lease(path, ttl_s=5)
        left = store._leases[lease_id].expires_at - now()
        await store.close()
        return left

    async def second() -> float | None:
        store = SqliteStore(path, sweep_interval_s=3600)
        await store.start()
        try:
            entry = await store.get("agent/0")
            return None if entry is None else store._leases[entry.lease or 0].expires_at
        finally:
            await store.close()

    left = asyncio.run(first())
    time.sleep(6)  # down longer than the lease had left
    expires_at = asyncio.run(second())
    assert expires_at is not None, "the lease lapsed while no registry served it"
    assert expires_at - now() == pytest.approx(left - 0.0, abs=1.0)


def test_a_renewal_that_is_the_first_thing_after_a_stall_renews(tmp_path: Path) -> None:
    """The renewal itself finds the stall (no tick nor read ran between): the lease is judged
    with the stall credited, not with the expiry it had before (a heartbeat queued in a
    SIGSTOPped registry under CPU load was refused 404 so, 3 runs in 12)."""

    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "first.db")
        try:
            await _stall_past_expiry(store, lease_id, 0.5)
            assert await store.refresh_lease(lease_id) is not None, "refused after a stall"
        finally:
            await store.close()

    asyncio.run(main())


def test_a_renewal_answered_just_before_a_shutdown_outlives_the_restart(tmp_path: Path) -> None:
    """A renewal is written with the next commit or sweep; one answered after the last of them
    reaches the file as the store closes. Else the restart credited the downtime from the last
    renewal on file, and the lease came back with what it had left then (3 s of 5 here)."""
    path = tmp_path / "close.db"

    async def first() -> float:
        store = SqliteStore(path, sweep_interval_s=3600)  # no sweep writes the renewals
        await store.start()
        a, b = await store.grant_lease(5), await store.grant_lease(5)
        assert (await store.txn([], [Put("a", b"x", a.id), Put("b", b"x", b.id)])).succeeded
        await asyncio.sleep(2.0)
        assert await store.refresh_lease(a.id) is not None
        assert (await store.txn([], [Put("other", b"x")])).succeeded  # writes a's renewal
        await asyncio.sleep(1.5)
        assert await store.refresh_lease(b.id) is not None  # answered, on no commit yet
        left = store._leases[b.id].expires_at - now()
        await store.close()
        return left

    async def second() -> float:
        store = SqliteStore(path, sweep_interval_s=3600)
        await store.start()
        try:
            entry = await store.get("b")
            assert entry is not None, "b's lease lapsed"
            assert entry.lease is not None
            return store._leases[entry.lease].expires_at - now()
        finally:
            await store.close()

    left = asyncio.run(first())
    assert asyncio.run(second()) == pytest.approx(left, abs=0.5), "b's renewal was lost"


def test_a_store_closing_refuses_renewals_it_could_no_longer_write(tmp_path: Path) -> None:
    """Once the store closes, a renewal is refused (503, naming the shutdown): the renewals
    written at close are all it answered (before, one arriving meanwhile renewed in memory and
    was lost with it)."""

    async def main() -> None:
        store, lease_id = await _store_with_lease(tmp_path / "closing.db")
        await store.close()
        with pytest.raises(Unavailable, match="shutting down"):
            await store.refresh_lease(lease_id)

    asyncio.run(main())
