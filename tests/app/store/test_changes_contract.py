"""The storage contract's change stream (``Store.changes``), against every backend: SQLite's
bounded history and etcd's own watch (plain and over TLS with auth)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aetcd import rpc

from app.store import ChangeBatch, Compacted, Delete, Put, Store
from app.store.etcd.store import EtcdStore
from app.store.sqlite.store import SqliteStore
from tests.app.store.conftest import StoreFactory
from tests.app.store.test_contract import run

pytestmark = [pytest.mark.store, pytest.mark.timeout(60)]

DEADLINE_S = 10.0


async def take(stream: AsyncIterator[ChangeBatch], n: int) -> list[ChangeBatch]:
    """The next ``n`` batches that change something (progress skipped), within the deadline."""
    got: list[ChangeBatch] = []
    async with asyncio.timeout(DEADLINE_S):
        while len(got) < n:
            batch = await anext(stream)
            if batch.changes:
                got.append(batch)
    return got


def test_changes_deliver_puts_and_deletes_in_revision_order_from_a_revision(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        first = await store.txn([], [Put("w/a", b"1")])
        await store.txn([], [Put("other", b"x")])  # outside the prefix: not delivered
        second = await store.txn([], [Put("w/b", b"2"), Put("w/c", b"3")])
        third = await store.txn([], [Delete("w/", prefix=True)])
        stream = store.changes("w/", first.revision, 0.5)
        try:
            got = await take(stream, 3)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        assert [b.revision for b in got] == [first.revision, second.revision, third.revision]
        assert [(c.key, c.entry and c.entry.value) for c in got[0].changes] == [("w/a", b"1")]
        assert sorted((c.key, c.entry and c.entry.value) for c in got[1].changes) == [
            ("w/b", b"2"),
            ("w/c", b"3"),
        ]
        assert sorted((c.key, c.entry) for c in got[2].changes) == [
            ("w/a", None),
            ("w/b", None),
            ("w/c", None),
        ]

    run(store_factory, tmp_path, body)


def test_changes_report_progress_while_quiet_and_deliver_what_comes_later(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        start = await store.txn([], [Put("q/x", b"0")])
        other = await store.txn([], [Put("elsewhere", b"1")])
        stream = store.changes("q/", start.revision + 1, 0.3)
        try:
            async with asyncio.timeout(DEADLINE_S):
                quiet = await anext(stream)
            assert quiet.changes == ()
            assert quiet.revision >= other.revision  # progress past changes elsewhere
            later = await store.txn([], [Put("q/y", b"2")])
            (batch,) = await take(stream, 1)
            assert batch.revision == later.revision
            assert [c.key for c in batch.changes] == ["q/y"]
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    run(store_factory, tmp_path, body)


def test_a_change_elsewhere_is_reported_as_progress_without_waiting_for_the_interval(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    """A reader that waits for the stream to reach the store's revision (a list page, the
    status page) after a write outside the prefix (an event, say) is told at once, not at the
    next interval: SQLite's stream looked at the change and waited out progress_s (up to 1 s
    on a list page), whatever the nudge."""

    async def body(store: Store) -> None:
        start = await store.txn([], [Put("p/x", b"0")])
        nudge = asyncio.Event()
        stream = store.changes("p/", start.revision + 1, 60.0, nudge)
        try:
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.2)
            other = await store.txn([], [Put("elsewhere", b"1")])
            nudge.set()  # what the watch feed does when a reader waits on it
            async with asyncio.timeout(DEADLINE_S):
                told = await waiting
                while told.revision < other.revision:
                    told = await anext(stream)
            assert told.changes == ()
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    run(store_factory, tmp_path, body)


def test_an_expired_lease_is_a_delete_in_the_changes(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(1)
        put = await store.txn([], [Put("l/k", b"v", lease=lease.id)])
        stream = store.changes("l/", put.revision, 0.5)
        try:
            if isinstance(store, SqliteStore):
                await asyncio.sleep(1.1)
                await store.purge_expired()
            got = await take(stream, 2)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        assert got[0].changes[0].entry is not None
        assert got[1].revision > put.revision
        assert [(c.key, c.entry) for c in got[1].changes] == [("l/k", None)]

    run(store_factory, tmp_path, body)


async def compact(store: Store, revision: int) -> None:
    """Drop the history before ``revision``: etcd's Compact; SQLite keeps fewer revisions."""
    if isinstance(store, EtcdStore):
        request = rpc.CompactionRequest(revision=revision, physical=True)
        await store._call("compact", lambda c, t: c.kvstub.Compact(request, timeout=t))
    else:
        assert isinstance(store, SqliteStore)
        keep, store._history.keep = store._history.keep, 1
        await store.txn([], [Put("pad", b"")])
        store._history.keep = keep


def test_changes_from_before_the_kept_history_raise_compacted_with_the_oldest(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    async def body(store: Store) -> None:
        first = await store.txn([], [Put("c/a", b"1")])
        for i in range(3):
            last = await store.txn([], [Put("c/a", str(i).encode())])
        await compact(store, last.revision)
        stream = store.changes("c/", first.revision, 0.5)
        with pytest.raises(Compacted) as raised:
            async with asyncio.timeout(DEADLINE_S):
                await anext(stream)
        assert first.revision < raised.value.oldest <= last.revision + 1
        # From the oldest kept revision on, the stream serves again.
        after = await store.txn([], [Put("c/b", b"2")])
        again = store.changes("c/", raised.value.oldest, 0.5)
        try:
            got = await take(again, 1)
        finally:
            await again.aclose()  # type: ignore[attr-defined]
        assert got[-1].revision <= after.revision

    run(store_factory, tmp_path, body)
