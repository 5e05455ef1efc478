"""The SQLite store's pending changes (app/store/sqlite/pending.py): a read of a key whose
commit has landed but whose bookkeeping callback has not run yet."""

from __future__ import annotations

import asyncio

import pytest

from app.store.sqlite.pending import Pending

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def test_a_key_read_in_the_turn_its_commit_landed_does_not_spin_the_loop() -> None:
    """A commit's future is done, but ``track``'s callback that forgets its keys runs only on
    the loop's next turn: ``settle_keys`` must return, not wait on the same done commit again
    without ever yielding (the whole registry froze: seen as a Mooncake registration racing
    a relaunch on a loaded machine)."""

    async def main() -> None:
        pending = Pending("registry.db", timeout_s=5.0, max_pending=100)
        commit = asyncio.get_running_loop().create_future()
        pending.track(commit, ["engines/e1"], lambda failure: None)
        commit.set_result(None)  # committed; the bookkeeping callback is only scheduled
        assert "engines/e1" in pending.keys
        await pending.settle_keys(["engines/e1"])
        await asyncio.sleep(0)
        assert "engines/e1" not in pending.keys

    asyncio.run(asyncio.wait_for(main(), 5))
