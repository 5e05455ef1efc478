"""The storage contract (app/store/base.py), run against every backend."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from app.store import Compare, Delete, Put, Store
from tests.app.store.conftest import StoreFactory

pytestmark = pytest.mark.store


def run(factory: StoreFactory, tmp_path: Path, body: object) -> None:
    async def main() -> None:
        async with factory(tmp_path) as store:
            await body(store)  # type: ignore[operator]

    asyncio.run(main())


def test_put_then_get_returns_value_and_revision(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        assert await store.get("a") is None
        result = await store.txn([], [Put("a", b"1")])
        assert result.succeeded
        entry = await store.get("a")
        assert entry is not None
        assert entry.value == b"1"
        assert entry.mod_revision == result.revision

    run(store_factory, tmp_path, body)


def test_compare_on_absent_key_lets_exactly_one_creator_win(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        results = await asyncio.gather(
            *(store.txn([Compare("k", 0)], [Put("k", str(i).encode())]) for i in range(20))
        )
        winners = [i for i, r in enumerate(results) if r.succeeded]
        assert len(winners) == 1
        entry = await store.get("k")
        assert entry is not None
        assert entry.value == str(winners[0]).encode()

    run(store_factory, tmp_path, body)


def test_failed_compare_changes_nothing(store_factory: StoreFactory, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        first = await store.txn([], [Put("a", b"1")])
        lost = await store.txn(
            [Compare("a", first.revision + 1000)], [Put("a", b"2"), Put("b", b"x")]
        )
        assert not lost.succeeded
        entry = await store.get("a")
        assert entry is not None
        assert entry.value == b"1"
        assert await store.get("b") is None

    run(store_factory, tmp_path, body)


def test_revisions_strictly_increase_across_writes(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        revisions = [(await store.txn([], [Put(f"k{i}", b"v")])).revision for i in range(5)]
        assert revisions == sorted(set(revisions))

    run(store_factory, tmp_path, body)


def test_range_returns_only_the_prefix_in_key_order(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        await store.txn(
            [], [Put("groups/a/2", b"2"), Put("groups/a/1", b"1"), Put("groups/ab/1", b"x")]
        )
        snap = await store.range("groups/a/")
        assert [e.key for e in snap.entries] == ["groups/a/1", "groups/a/2"]
        assert snap.revision >= max(e.mod_revision for e in snap.entries)

    run(store_factory, tmp_path, body)


def test_prefix_delete_removes_only_that_prefix(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        await store.txn([], [Put("g/a/1", b"1"), Put("g/a/2", b"2"), Put("g/b/1", b"3")])
        assert (await store.txn([], [Delete("g/a/", prefix=True)])).succeeded
        assert [e.key for e in (await store.range("g/")).entries] == ["g/b/1"]

    run(store_factory, tmp_path, body)


def test_entry_on_a_lease_vanishes_when_it_expires(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(1)
        await store.txn([], [Put("agent", b"x", lease=lease.id)])
        entry = await store.get("agent")
        assert entry is not None
        assert entry.lease == lease.id
        deadline = time.monotonic() + 10
        while await store.get("agent") is not None:
            assert time.monotonic() < deadline, "leased entry outlived its lease by 9 s"
            await asyncio.sleep(0.1)
        assert await store.refresh_lease(lease.id) is None

    run(store_factory, tmp_path, body)


def test_refreshed_lease_outlives_its_first_ttl(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(2)
        await store.txn([], [Put("agent", b"x", lease=lease.id)])
        for _ in range(4):
            await asyncio.sleep(1.0)
            refreshed = await store.refresh_lease(lease.id)
            assert refreshed is not None
            assert refreshed.remaining_s > 1.0
        assert await store.get("agent") is not None

    run(store_factory, tmp_path, body)


def test_revoked_lease_deletes_its_entries_now(store_factory: StoreFactory, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(60)
        await store.txn([], [Put("a", b"1", lease=lease.id), Put("b", b"2", lease=lease.id)])
        await store.revoke_lease(lease.id)
        assert await store.get("a") is None
        assert await store.get("b") is None
        await store.revoke_lease(lease.id)  # a second revoke is a no-op

    run(store_factory, tmp_path, body)


def test_put_with_an_expired_lease_fails_like_a_lost_compare(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(60)
        await store.revoke_lease(lease.id)
        result = await store.txn([], [Put("a", b"1", lease=lease.id)])
        assert not result.succeeded
        assert await store.get("a") is None

    run(store_factory, tmp_path, body)


def test_range_reports_remaining_lease_time(store_factory: StoreFactory, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(30)
        await store.txn([], [Put("p/a", b"1", lease=lease.id)])
        snap = await store.range("p/")
        assert 20 < snap.lease_remaining_s[lease.id] <= 30

    run(store_factory, tmp_path, body)


def test_wait_wakes_on_a_write_under_the_prefix(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        start = await store.txn([], [Put("x/0", b"0")])

        async def writer() -> None:
            await asyncio.sleep(0.3)
            await store.txn([], [Put("x/1", b"1")])

        task = asyncio.create_task(writer())
        t0 = time.monotonic()
        assert await store.wait("x/", start.revision, 10)
        assert time.monotonic() - t0 < 5
        await task

    run(store_factory, tmp_path, body)


def test_wait_times_out_when_nothing_changes(store_factory: StoreFactory, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        start = await store.txn([], [Put("y/0", b"0")])
        t0 = time.monotonic()
        assert not await store.wait("y/", start.revision, 0.5)
        assert 0.4 < time.monotonic() - t0 < 3

    run(store_factory, tmp_path, body)


def test_wait_returns_at_once_for_a_change_already_made(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        before = await store.txn([], [Put("z/0", b"0")])
        await store.txn([], [Put("z/1", b"1")])
        t0 = time.monotonic()
        assert await store.wait("z/", before.revision, 10)
        assert time.monotonic() - t0 < 2

    run(store_factory, tmp_path, body)


def test_ping_answers_on_a_healthy_store(store_factory: StoreFactory, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        await store.ping()

    run(store_factory, tmp_path, body)
