"""Watch streams: ``GET /tp-groups?watch=true``, one JSON object per line.

A watcher is a position in the feed's log (no queue of its own): it writes what it has not
sent, whole revisions at a time, in chunks, then waits for the feed's next progress. That is
bounded by the log (a watcher it drops is told ``revision_compacted``) and by its send budget,
the bytes that arrived since it subscribed and are not written (past it: ``slow_consumer``).
A consumer that stops reading stalls its writes in the transport; the hub notices its lag,
gives it a second, then cuts the connection. Streams end with a final ``ERROR`` line:
``slow_consumer``, ``revision_compacted`` or ``shutting_down`` (SIGTERM: first, within
``DRAIN_S``, the feed catches up with the store and each stream whose connection takes it
sends what the log holds for it, so its watcher resumes from the store's revision).
"""

from __future__ import annotations

import asyncio
import contextlib

from app.core.errors import RevisionCompacted, ShuttingDown, TooManyWatchers
from app.core.metrics import Metrics
from app.core.problems import error_line
from app.store.tasks import stop
from app.watch.feed import Feed
from app.watch.history import Selector
from app.watch.pages import refuse_ahead
from app.watch.sender import LINGER_S, TRANSPORT, WatchStream

# TRANSPORT: app/server/protocol.py imports it from here
__all__ = ["TRANSPORT", "WatchStream", "Watchers"]

# A watch admitted (counted against REGISTRY_WATCH_MAX) whose response the server never started
# (the request failed after the route) stops counting after this long.
UNSENT_S = 30.0
# SIGTERM: how long the streams may still send what the log holds (the feed's catch-up with
# the store included) before each ends with ``shutting_down``; a restarted SQLite registry
# keeps history from the file's revision, and a watcher short of it would list again.
DRAIN_S = 1.0


class Watchers:
    """The watch streams of one replica: the limit on how many, their budgets, bookmarks."""

    def __init__(
        self,
        feed: Feed,
        metrics: Metrics,
        *,
        max_watchers: int,
        budget_bytes: int,
        bookmark_s: float,
    ) -> None:
        self.feed = feed
        self.metrics = metrics
        self.max_watchers = max_watchers
        self.budget_bytes = budget_bytes
        self.bookmark_s = bookmark_s
        self.open: set[WatchStream] = set()
        self.draining = False
        # The lines from a position to the log's end, per filter: watchers that are
        # caught up stand at the same position, so one join serves them all.
        self._chunks: dict[tuple[int, Selector], tuple[bytes, bytes, int, int]] = {}
        self._chunks_end = -1
        self._monitor: asyncio.Task[None] | None = None
        self._broadcaster: asyncio.Task[None] | None = None
        self._drainer: asyncio.Task[None] | None = None
        self._emptied = asyncio.Event()  # set when the last stream ends while draining

    async def watch(self, after: int | None, selector: Selector, timeout_s: float) -> WatchStream:
        """A stream of the changes after revision ``after`` (None: from now) that pass
        ``selector``. The stream counts against ``max_watchers`` from here on (admission and
        count are one step), until it ends or, never started, the hub sweeps it."""
        if self.draining:
            raise ShuttingDown(
                "This replica is shutting down: watch another one (or this one once restarted) "
                "from your revision."
            )
        if len(self.open) >= self.max_watchers:
            raise TooManyWatchers(
                f"This replica serves {self.max_watchers} watches (REGISTRY_WATCH_MAX): watch "
                "another replica, or retry later."
            )
        stream = WatchStream(self, selector)
        self.added(stream)
        try:
            await self.feed.ready(timeout_s)
            if after is not None and after > self.feed.progress:
                await refuse_ahead(self.feed.store, after, "watch")
            log = self.feed.log
            if after is None:
                after = self.feed.progress
            elif after < log.oldest:
                raise RevisionCompacted(
                    f"revision {after} is older than the history this replica keeps (from "
                    f"revision {log.oldest}): list the groups again (GET /tp-groups answers the "
                    "revision to watch from) and watch from the list's revision.",
                    oldest_revision=log.oldest,
                )
        except BaseException:
            self.removed(stream)
            raise
        stream.start_at(after)
        return stream

    def chunk(self, start: int, selector: Selector) -> tuple[bytes, bytes, int, int]:
        """The lines of the events from ``start`` to the log's end for watchers filtered by
        ``selector``: the bytes, the same as one HTTP chunk, how many, and the last event's
        revision."""
        log = self.feed.log
        if self._chunks_end != log.end:
            self._chunks.clear()
            self._chunks_end = log.end
        hit = self._chunks.get((start, selector))
        if hit is None:
            parts: list[bytes] = []
            last = 0
            for position in range(start, log.end):
                event = log.at(position)
                assert event is not None
                last = event.revision
                if (line := event.line_for(selector)) is not None:
                    parts.append(line)
            data = b"".join(parts)
            framed = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
            hit = self._chunks[(start, selector)] = (data, framed, len(parts), last)
        return hit

    def drain(self) -> None:
        """SIGTERM: no new streams; the open ones send what the log holds for them, then end
        with ``shutting_down`` (all within ``DRAIN_S``)."""
        if self.draining:
            return
        self.draining = True
        try:
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        except RuntimeError:  # no loop running: nothing can be sent
            self._end_all()

    async def drained(self) -> None:
        """``drain``, then wait until every stream has been told to end (at most ``DRAIN_S``
        and the feed's catch-up)."""
        self.drain()
        if self._drainer is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._drainer)

    async def _drain(self) -> None:
        if not self.open:  # nothing to send: the feed's catch-up would only delay the exit
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        # Changes answered before the signal that the feed has not applied yet (bounded: a
        # store that does not answer leaves the streams the rest of the time).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.feed.caught_up(DRAIN_S / 2), DRAIN_S / 2)
        for stream in list(self.open):
            stream.drain(deadline)
        # Each stream ends itself once it sent what it had: the rest end at the deadline.
        if self.open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._emptied.wait(), max(0.0, deadline - loop.time()))
        self._end_all()

    def _end_all(self) -> None:
        for stream in list(self.open):
            stream.finish(stream.shutting_down_line())

    async def close(self) -> None:
        """At the end of the lifespan (every stream has ended): stop the hub's tasks."""
        self.draining = True
        self._end_all()
        for task in (self._drainer, self._monitor, self._broadcaster):
            if task is not None and not task.done():
                await stop(task)  # the broadcaster loops on wait_for: a lost cancel is retried

    def added(self, stream: WatchStream) -> None:
        self.open.add(stream)
        self.metrics.watchers.set(len(self.open))
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.create_task(self._watch_budgets())
        if self._broadcaster is None or self._broadcaster.done():
            self._broadcaster = asyncio.create_task(self._broadcast())

    async def _broadcast(self) -> None:
        """While any stream is open: at each progress of the feed (at most one pass per
        ``LINGER_S``), write the new lines straight to every stream that is caught up and
        whose connection keeps up (one shared chunk per filter, no task woken per stream);
        wake the others, which send on their own (``WatchStream._pump``)."""
        loop = asyncio.get_running_loop()
        last = 0.0
        while self.open:
            news = self.feed.news()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(news), 1.0)
            if not news.done():
                continue
            if (wait := last + LINGER_S - loop.time()) > 0:
                await asyncio.sleep(wait)
            last = loop.time()
            sent = 0
            for stream in list(self.open):
                if stream.live and not stream.ended:
                    handled = stream.direct(last)
                    if handled is None:
                        stream.wake()
                    else:
                        sent += handled
            if sent:
                self.metrics.watch_events_sent.inc(sent)

    def removed(self, stream: WatchStream) -> None:
        self.open.discard(stream)
        self.metrics.watchers.set(len(self.open))
        if self.draining and not self.open:
            self._emptied.set()

    async def _watch_budgets(self) -> None:
        """While any stream is open: each one's unsent bytes against its budget."""
        log = self.feed.log
        while self.open:
            await asyncio.sleep(0.1)
            now = asyncio.get_running_loop().time()
            for stream in list(self.open):
                if not stream.called:  # admitted, never sent: its request went away
                    if now - stream.admitted_at > UNSENT_S:
                        self.removed(stream)
                    continue
                if stream.ended:
                    continue
                if stream.epoch != self.feed.epoch or stream.position < log.offset:
                    stream.finish(stream.compacted_line(), slow=stream.epoch == self.feed.epoch)
                    continue
                unsent = log.bytes_after(max(stream.position, stream.base))
                if unsent > self.budget_bytes:
                    stream.finish(
                        error_line(
                            stream.revision,
                            "slow_consumer",
                            503,
                            f"This stream fell {unsent} bytes behind (its send budget is "
                            f"{self.budget_bytes}, REGISTRY_WATCH_SEND_BUDGET_BYTES): read "
                            "faster, then watch again from this revision.",
                        ),
                        slow=True,
                    )
