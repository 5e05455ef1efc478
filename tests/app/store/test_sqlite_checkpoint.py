"""The SQLite store's WAL checkpoints run on their own thread (app/store/sqlite/checkpoint.py),
on a real file: past ``EVERY_BYTES`` of commits the thread checkpoints the WAL into the
database file while commits go on, nothing is lost, and the store's close leaves no WAL
behind (its writer is the last connection)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from pathlib import Path

import pytest

from app.store import Put
from app.store.sqlite.checkpoint import BACKSTOP_PAGES, EVERY_BYTES
from app.store.sqlite.store import SqliteStore

pytestmark = pytest.mark.store

VALUE = 64 * 1024


def test_the_wal_is_checkpointed_off_the_commits_and_nothing_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    values = EVERY_BYTES // VALUE + 8  # past one checkpoint's worth

    async def main() -> None:
        store = SqliteStore(path, timeout_s=5.0)
        await store.start()
        try:
            file = store._thread.file
            conn = file._conn
            assert conn is not None
            autocheckpoint = await store._thread.call(
                lambda: conn.execute("PRAGMA wal_autocheckpoint").fetchone(), 5.0
            )
            assert autocheckpoint == (BACKSTOP_PAGES,)  # SQLite's own: only as a backstop
            for i in range(values):
                assert (await store.txn([], [Put(f"k/{i:04d}", os.urandom(VALUE))])).succeeded
            for _ in range(500):  # bounded: 10 s
                if file.checkpointer.checkpoints:
                    break
                await asyncio.sleep(0.02)
            assert file.checkpointer.checkpoints >= 1, "the checkpoint thread never ran"
            # The pages the thread copied are in the database file itself.
            copied.append(os.stat(path).st_size)
        finally:
            await store.close()

    copied: list[int] = []
    asyncio.run(main())
    assert copied[0] >= EVERY_BYTES
    assert not Path(f"{path}-wal").exists(), "the WAL outlived the store's close"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM kv").fetchone() == (values,)


def test_the_checkpoint_thread_never_makes_a_deleted_file_again(tmp_path: Path) -> None:
    path = tmp_path / "r.db"

    async def main() -> None:
        store = SqliteStore(path, timeout_s=5.0)
        await store.start()
        try:
            await store.txn([], [Put("k", b"v")])
            await asyncio.to_thread(delete)
            store._thread.file.checkpointer.wrote(EVERY_BYTES)  # its first checkpoint
            await asyncio.sleep(0.2)
            exists.append(await asyncio.to_thread(path.exists))
        finally:
            await store.close()

    def delete() -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)

    exists: list[bool] = []
    asyncio.run(main())
    assert exists == [False], "the checkpoint thread created the deleted file"
