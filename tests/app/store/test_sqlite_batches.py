"""The SQLite store's group commit, on a real file: while the file's thread is held busy,
changes queue up and are then written as one batch, reduced to each key's last state; reads
wait exactly for the changes under their prefix that are not durable yet."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path

import pytest

from app.store import Delete, Entry, Put
from app.store.sqlite.store import SqliteStore

pytestmark = pytest.mark.store


async def _hold_thread(store: SqliteStore) -> tuple[threading.Event, asyncio.Task[None]]:
    """Occupy the file's thread until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def block() -> None:
        started.set()
        release.wait(10.0)

    held = asyncio.ensure_future(store._thread.call(block, 10.0))
    for _ in range(200):  # bounded: the thread starts within a second
        if started.is_set():
            break
        await asyncio.sleep(0.005)
    assert started.is_set(), "the file thread never ran the blocking call"
    return release, held


async def _reloaded(path: Path, prefix: str) -> list[Entry]:
    """The entries under ``prefix`` as a fresh store loads them from the file."""
    again = SqliteStore(path, timeout_s=5.0)
    await again.start()
    try:
        return (await again.range(prefix)).entries
    finally:
        await again.close()


async def _in_one_batch(store: SqliteStore, batches: list[list[Put | Delete]]) -> None:
    """Queue every transaction while the file's thread is held, then let them commit."""
    release, held = await _hold_thread(store)
    writes = [asyncio.ensure_future(store.txn([], ops)) for ops in batches]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in writes), "a write answered before it was durable"
    release.set()
    await held
    assert all(r.succeeded for r in await asyncio.gather(*writes))


def test_a_batch_keeps_each_keys_last_state_after_a_reload(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", timeout_s=5.0)
        await store.start()
        lease = await store.grant_lease(60)
        gone = await store.grant_lease(60)
        release, held = await _hold_thread(store)
        batches: tuple[list[Put | Delete], ...] = (
            [Put("g/a", b"1"), Put("g/b", b"1", lease=lease.id), Put("g/e", b"1")],
            [Delete("g/a")],
            [Put("g/a", b"2"), Put("g/c", b"x")],
            [Delete("g/c"), Put("g/b", b"3", lease=lease.id)],
            [Put("h/d", b"4", lease=gone.id)],
            [Delete("g/e"), Put("g/e", b"5")],  # one change deleting, then putting a key
        )
        writes = [asyncio.ensure_future(store.txn([], ops)) for ops in batches]
        await asyncio.sleep(0)
        revoked = asyncio.ensure_future(store.revoke_lease(gone.id))  # takes h/d with it
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in writes), "a write answered before it was durable"
        release.set()
        await held
        results = await asyncio.gather(*writes)
        assert all(r.succeeded for r in results)
        await revoked
        await store.close()

        entries = await _reloaded(tmp_path / "r.db", "")
        assert {e.key: e.value for e in entries} == {"g/a": b"2", "g/b": b"3", "g/e": b"5"}
        assert next(e for e in entries if e.key == "g/b").lease == lease.id

    asyncio.run(main())


def test_a_range_waits_for_pending_changes_under_its_prefix_only(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", timeout_s=5.0)
        await store.start()
        try:
            await store.txn([], [Put("groups/other/engine", b"o")])
            release, held = await _hold_thread(store)
            write = asyncio.ensure_future(store.txn([], [Put("groups/g/agents/00001", b"a")]))
            await asyncio.sleep(0)
            under = asyncio.ensure_future(store.range("groups/g/"))
            parent = asyncio.ensure_future(store.range("groups/"))
            # A prefix that does not end at a "/" takes the per-key path.
            partial = asyncio.ensure_future(store.range("groups/g/age"))
            elsewhere = await asyncio.wait_for(store.range("groups/other/"), 1.0)
            assert [e.value for e in elsewhere.entries] == [b"o"]
            await asyncio.sleep(0.05)
            assert not under.done()
            assert not parent.done()
            assert not partial.done()
            release.set()
            await held
            await write
            for read in (under, parent, partial):
                snap = await asyncio.wait_for(read, 5.0)
                assert b"a" in [e.value for e in snap.entries]
        finally:
            await store.close()

    asyncio.run(main())


def test_peek_reads_memory_only_for_keys_with_nothing_on_its_way(tmp_path: Path) -> None:
    """``peek`` (the heartbeat's read): live entries at once, None for a key expired or absent,
    and no answer at all while one of its keys has a change not yet durable."""

    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", timeout_s=5.0)
        await store.start()
        try:
            short = await store.grant_lease(5)
            await store.txn([], [Put("g/a", b"1"), Put("g/b", b"2", lease=short.id)])
            peeked = store.peek(["g/a", "g/b", "g/none"])
            assert peeked is not None
            assert [e.value if e else None for e in peeked] == [b"1", b"2", None]
            store._leases[short.id].expires_at = 0.0  # lapsed, not yet swept
            peeked = store.peek(["g/b"])
            assert peeked == [None]
            release, held = await _hold_thread(store)
            write = asyncio.ensure_future(store.txn([], [Put("g/a", b"3")]))
            await asyncio.sleep(0.05)
            assert not write.done()
            assert store.peek(["g/other", "g/a"]) is None  # g/a is on its way
            assert store.peek(["g/other"]) == [None]
            release.set()
            await held
            await write
            peeked = store.peek(["g/a"])
            assert peeked is not None
            assert peeked[0] is not None
            assert peeked[0].value == b"3"
        finally:
            await store.close()

    asyncio.run(main())


def test_a_batch_larger_than_one_statement_is_written_whole(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", timeout_s=5.0)
        await store.start()
        # 1,100 rows: a statement of 1,024 and one of 76 padded to 80 with copies of the last
        # row; then 1,099 deleted in one batch (1,024, then 75 padded to 80), the last one
        # put again over its copies.
        await _in_one_batch(store, [[Put(f"k/{i:04d}", b"v")] for i in range(1100)])
        deletes: list[list[Put | Delete]] = [[Delete(f"k/{i:04d}")] for i in range(1, 1100)]
        await _in_one_batch(store, [*deletes, [Put("k/1099", b"w")]])
        await store.close()
        entries = await _reloaded(tmp_path / "r.db", "k/")
        assert [(e.key, e.value) for e in entries] == [("k/0000", b"v"), ("k/1099", b"w")]
        with contextlib.closing(sqlite3.connect(tmp_path / "r.db")) as conn:
            assert conn.execute("SELECT count(*) FROM kv").fetchone() == (2,)
            revision = conn.execute("SELECT v FROM meta WHERE k='revision'").fetchone()[0]
        assert revision == 2200  # one revision a write, the last one's in the file

    asyncio.run(main())


def _leases_in_file(path: Path) -> set[int]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {row[0] for row in conn.execute("SELECT id FROM leases")}


def test_a_lease_is_written_with_the_change_that_uses_it_or_by_the_sweep(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", timeout_s=5.0, sweep_interval_s=0.05)
        await store.start()
        try:
            used = await store.grant_lease(60)
            assert (await store.txn([], [Put("k", b"v", lease=used.id)])).succeeded
            # Answered: the key and its lease are in the file (another connection sees them).
            assert used.id in _leases_in_file(tmp_path / "r.db")
            idle = await store.grant_lease(60)  # no change uses it: the sweep writes it
            for _ in range(100):  # bounded: a few sweep intervals
                if idle.id in _leases_in_file(tmp_path / "r.db"):
                    break
                await asyncio.sleep(0.02)
            assert idle.id in _leases_in_file(tmp_path / "r.db")
        finally:
            await store.close()

    asyncio.run(main())
