"""``python -m bench.feed_waits [--changes N] [--waiters W,W,...]``: what waits on the watch
feed's progress cost the event loop while changes come in.

A node's heartbeat on etcd renews its leases, then waits in ``Feed.reached`` until the feed
has applied every change up to the renewal's revision (``app/registry/renewals.py``). At
100,000 ranks on etcd thousands wait at once while a launch's changes come in. Here: a real
SQLite store and its feed in this process, W waiters spread over the revisions of the next N
changes (so each change releases about W/N of them, as renewals of one moment wait for about
the same revision), then the N changes written one at a time, each awaited until the feed has
applied it. Reported: the event loop's thread CPU a change, for each W, and its ratio to the
same run's W = 0 (the baseline: the changes alone). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.store import Put, create_store
from harness.feeds import registry_with_feed


async def one(changes: int, waiters: int) -> float:
    """The loop thread's CPU a change (µs) with ``waiters`` waiting."""
    with tempfile.TemporaryDirectory(prefix="feed-waits-") as tmp:
        store = create_store(f"sqlite:///{Path(tmp) / 'r.db'}")
        async with registry_with_feed(store) as (_, feed):
            head = (await store.txn([], [Put("groups/g/note", b"{}")])).revision
            assert await feed.reached(head, 10.0)
            waits = [
                asyncio.create_task(feed.reached(head + 1 + i % changes, 120.0))
                for i in range(waiters)
            ]
            await asyncio.sleep(0.1)  # every waiter is waiting
            started = time.thread_time()
            for step in range(changes):
                done = await store.txn([], [Put(f"groups/g{step % 64}/note", b"{}")])
                if not await feed.reached(done.revision, 10.0):
                    raise RuntimeError("the feed did not apply a change within 10 s")
            await asyncio.gather(*waits)
            spent = time.thread_time() - started
    return spent / changes * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=400)
    parser.add_argument("--waiters", default="0,1000,4000")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each W, interleaved")
    args = parser.parse_args(argv)
    sizes = [int(w) for w in args.waiters.split(",")]
    if 0 not in sizes:
        sizes.insert(0, 0)
    runs: dict[int, list[float]] = {w: [] for w in sizes}
    for _ in range(args.rounds):
        for w in sizes:
            runs[w].append(asyncio.run(one(args.changes, w)))
    base = sorted(runs[0])[len(runs[0]) // 2]
    out: dict[str, Any] = {"changes": args.changes, "rounds": args.rounds, "by_waiters": {}}
    for w in sizes:
        median = sorted(runs[w])[len(runs[w]) // 2]
        out["by_waiters"][str(w)] = {
            "loop_cpu_us_a_change": round(median, 1),
            "ratio_to_no_waiters": round(median / base, 2),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
