"""``python -m bench.feed_lag [--ranks 100000] [--quick]``: a replica's watch feed during a
fleet's launch on a 3-member etcd: how far behind etcd it falls, and what waits in the queue
between gRPC and the feed (``app/store/etcd/watch.py``, bounded at ``QUEUE_LIMIT`` responses).

The registry runs as ``bench.fleet`` runs it, in a process of its own, started through this
module (``python -m bench.feed_lag serve …``, then ``app.cli.main``) with two probes added:

- every 0.5 s the store's revision is read (``Store.revision``, one linearizable read) and
  the feed's lag is the time from that answer until the feed has applied every change up to
  it (``Feed.progress``): a lower bound, since the revision existed before it was read;
- the queue's fill: the most responses and bytes (protobuf's ``ByteSize``) waiting at once,
  and the fences the watch wrote to prove its progress.

The launch is ``bench.fleet_load.fleet_run``'s (TP 8 groups through the per-node routes,
heartbeats once registered), then a short steady window. Figures go to stdout as JSON
(``bench/results/feed_lag.json`` through ``bench.run``); nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import HOST, pct, say
from bench.fleet import BLOB_BYTES, HANDSHAKES_PER_S, REGIONS, _etcd
from bench.fleet_load import Fleet, fleet_run
from bench.watch import rss_mib
from workers.tools.procs import RegistryProcess

OUT_ENV = "BENCH_FEED_LAG_OUT"
LIMIT_ENV = "BENCH_FEED_LAG_QUEUE_LIMIT"
SAMPLE_S = 0.5


def serve(argv: list[str]) -> int:
    """The registry's ``serve`` (``argv``: ``python -m app serve …``) with the probes."""
    from app.cli import main
    from app.store.etcd import watch as etcd_watch
    from app.watch import feed as feeds

    out = Path(os.environ[OUT_ENV])
    seen: dict[str, Any] = {"lags": [], "peak_responses": 0, "peak_bytes": 0, "fences": 0}

    class Measured(etcd_watch.Inbox):
        def __init__(self, limit: int) -> None:
            super().__init__(limit)
            self.sizes: collections.deque[int] = collections.deque()
            self.bytes = 0

        async def put(self, response: Any) -> None:
            size = response.ByteSize() if hasattr(response, "ByteSize") else 0
            await super().put(response)
            self.sizes.append(size)
            self.bytes += size
            seen["peak_responses"] = max(seen["peak_responses"], self.waiting)
            seen["peak_bytes"] = max(seen["peak_bytes"], self.bytes)

        def note(self, note: Any) -> None:
            seen["fences"] += bool(note.revision)
            super().note(note)

        async def get(self) -> Any:
            item = await super().get()
            if not isinstance(item, etcd_watch._Note):
                self.bytes -= self.sizes.popleft()
            return item

    etcd_watch.Inbox = Measured  # type: ignore[misc]
    etcd_watch.QUEUE_LIMIT = int(os.environ.get(LIMIT_ENV) or etcd_watch.QUEUE_LIMIT)
    started = feeds.Feed.start
    probes: list[asyncio.Task[None]] = []

    async def probe(feed: feeds.Feed) -> None:
        pending: collections.deque[tuple[int, float]] = collections.deque()
        next_read = 0.0
        while not feed.closing:
            now = time.monotonic()
            while pending and feed.progress >= pending[0][0]:
                _, answered = pending.popleft()
                seen["lags"].append((round(time.time(), 2), round(now - answered, 3)))
            if now >= next_read:
                next_read = now + SAMPLE_S
                with contextlib.suppress(Exception):  # a failed read is no sample
                    pending.append((await feed.store.revision(), time.monotonic()))
                text = json.dumps(seen | {"behind": len(pending)})
                await asyncio.to_thread(out.write_text, text)
            await asyncio.sleep(0.01)

    def start(self: feeds.Feed) -> None:
        started(self)
        probes.append(asyncio.get_running_loop().create_task(probe(self)))

    feeds.Feed.start = start  # type: ignore[method-assign]
    return main(argv[argv.index("app") + 1 :])


def launch(ranks: int, quick: bool, limit: int | None = None) -> dict[str, Any]:
    """One launch; ``limit``: the queue's bound (default ``QUEUE_LIMIT``; a huge one is the
    unbounded queue before it)."""
    with tempfile.TemporaryDirectory(prefix="bench-feed-lag-") as name:
        tmp = Path(name)
        stats = tmp / "feed.json"
        with _etcd(tmp) as cluster:
            registry = RegistryProcess(
                cluster.url("feedlag"),
                host=HOST,
                prefix=[sys.executable, "-m", "bench.feed_lag", "serve"],
                env={OUT_ENV: str(stats), LIMIT_ENV: str(limit or "")},
                log_path=tmp / "registry.log",
            ).start(timeout_s=60)
            fleet = Fleet(ranks, BLOB_BYTES, REGIONS)
            t0 = time.time()
            try:
                out = asyncio.run(
                    fleet_run(
                        registry.url,
                        fleet,
                        warmup_s=2.0,
                        window_s=3.0 if quick else 10.0,
                        handshakes_per_s=HANDSHAKES_PER_S,
                    )
                )
                rss = rss_mib(registry.pid)
            finally:
                registry.stop()
            seen = json.loads(stats.read_text())
    ready_at = t0 + out["launch"]["ready_s"]
    during = [lag for at, lag in seen["lags"] if at <= ready_at]
    after = [lag for at, lag in seen["lags"] if at > ready_at]
    return {
        "ranks": ranks,
        "launch": out["launch"],
        "feed_lag_s": {
            "launch": _summary(during),
            "after": _summary(after),
            "unresolved_at_end": seen["behind"],
        },
        "queue": {
            "limit": limit or _limit(),
            "peak_responses": seen["peak_responses"],
            "peak_kib": round(seen["peak_bytes"] / 1024, 1),
        },
        "fences": seen["fences"],
        "registry_rss_mib": rss,
    }


def _limit() -> int:
    from app.store.etcd.watch import QUEUE_LIMIT

    return QUEUE_LIMIT


def _summary(lags: list[float]) -> dict[str, float | int]:
    if not lags:
        return {"n": 0}
    return {
        "n": len(lags),
        "p50": round(pct(lags, 50), 3),
        "p99": round(pct(lags, 99), 3),
        "max": round(max(lags), 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    ranks = 2000 if quick else 100_000
    say(f"feed_lag: a launch of {ranks} ranks on a 3-member etcd")
    return {"rows": [launch(ranks, quick)]}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        return serve(args[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.feed_lag", description=__doc__)
    parser.add_argument("--ranks", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="a short steady window")
    parser.add_argument("--queue-limit", type=int, default=None, help="the queue's bound")
    opts = parser.parse_args(args)
    print(json.dumps(launch(opts.ranks, opts.quick, opts.queue_limit), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
