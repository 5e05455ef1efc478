"""The SQLite store's history of durable changes (app/store/sqlite/history.py): bounded by the
number of revisions and by the bytes of the values it holds, trimmed from the oldest."""

from __future__ import annotations

import asyncio

import pytest

from app.store import Entry
from app.store.sqlite.file import Change
from app.store.sqlite.history import History

pytestmark = pytest.mark.unit


def _record(history: History, revision: int, size: int) -> None:
    change = Change(revision, 1, puts=[Entry(f"blobs/g{revision}/0", b"x" * size, revision)])
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    history.record(change, fut)
    fut.set_result(None)


def test_the_history_keeps_at_most_its_bytes_of_values_and_moves_oldest_past_the_rest() -> None:
    async def scenario() -> History:
        history = History(keep=1_000, keep_bytes=10_000)
        history.reset(0)
        for revision in range(1, 11):
            _record(history, revision, 3_000)
        await asyncio.sleep(0)  # the commits' callbacks
        return history

    history = asyncio.run(scenario())
    assert history.durable == 10
    assert history.bytes <= 10_000
    assert history.bytes == 9_000  # the newest three revisions' values
    assert history.oldest == 7  # a watch from before revision 8 is told to list again


def test_one_change_larger_than_the_budget_is_still_kept_alone() -> None:
    async def scenario() -> History:
        history = History(keep=1_000, keep_bytes=1_000)
        history.reset(0)
        _record(history, 1, 10)
        _record(history, 2, 5_000)
        await asyncio.sleep(0)
        return history

    history = asyncio.run(scenario())
    assert history.oldest == 1
    assert history.bytes == 5_000
