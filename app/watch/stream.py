"""Watch streams: ``GET /tp-groups?watch=true``, one JSON object per line.

A watcher is a position in the feed's log (no queue of its own): it writes what it has not
sent, whole revisions at a time, in chunks, then waits for the feed's next progress. That is
bounded by the log (a watcher it drops is told ``revision_compacted``) and by its send budget,
the bytes that arrived since it subscribed and are not written (past it: ``slow_consumer``).
A consumer that stops reading stalls its writes in the transport; the hub notices its lag,
gives it a second, then cuts the connection. Streams end with a final ``ERROR`` line:
``slow_consumer``, ``revision_compacted`` or ``shutting_down`` (SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.core.errors import RevisionCompacted, TooManyWatchers
from app.core.metrics import Metrics
from app.core.problems import error_line
from app.watch.feed import Feed
from app.watch.history import ANY, Selector
from app.watch.pages import refuse_ahead

MEDIA_TYPE = "application/x-ndjson"
CHUNK_BYTES = 256 * 1024
GRACE_S = 1.0  # a cut-off consumer's time to read what is on its way
# After a write, changes gather this long before the next one: a storm's go out as one write
# per stream per LINGER_S, not one per change (which cost the storm a quarter of its rate at
# 100 watchers); a lone change goes out at once.
LINGER_S = 0.05
SHARED_EVENTS = 256  # a caught-up watcher's next events come from the hub's shared chunk
DIRECT_BUFFER = 64 * 1024  # a connection holding more unsent bytes sends on its own
# scope["extensions"]: the connection's asyncio transport (app/server/serve.py puts it there)
TRANSPORT = "engine_registry.transport"
# A watch connection's kernel send buffer (Linux doubles it), not the few MB it may grow to.
SNDBUF = 64 * 1024
# A watch admitted (counted against REGISTRY_WATCH_MAX) whose response the server never started
# (the request failed after the route) stops counting after this long.
UNSENT_S = 30.0


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

    async def watch(self, after: int | None, selector: Selector, timeout_s: float) -> WatchStream:
        """A stream of the changes after revision ``after`` (None: from now) that pass
        ``selector``. The stream counts against ``max_watchers`` from here on (admission and
        count are one step), until it ends or, never started, the hub sweeps it."""
        if self.draining:
            raise TooManyWatchers("This replica is shutting down: watch another one.")
        if len(self.open) >= self.max_watchers:
            raise TooManyWatchers(
                f"This replica serves {self.max_watchers} watches (REGISTRY_WATCH_MAX): watch "
                "another replica, or retry later."
            )
        stream = WatchStream(self, selector)
        self._added(stream)
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
            self._removed(stream)
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
        """SIGTERM: every stream ends now with ``shutting_down``."""
        self.draining = True
        for stream in list(self.open):
            stream.finish(
                error_line(
                    stream.revision,
                    "shutting_down",
                    503,
                    "This replica is shutting down: watch another one from this revision.",
                )
            )

    async def close(self) -> None:
        """At the end of the lifespan (every stream has ended): stop the hub's tasks."""
        self.drain()
        for task in (self._monitor, self._broadcaster):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _added(self, stream: WatchStream) -> None:
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

    def _removed(self, stream: WatchStream) -> None:
        self.open.discard(stream)
        self.metrics.watchers.set(len(self.open))

    async def _watch_budgets(self) -> None:
        """While any stream is open: each one's unsent bytes against its budget."""
        log = self.feed.log
        while self.open:
            await asyncio.sleep(0.1)
            now = asyncio.get_running_loop().time()
            for stream in list(self.open):
                if not stream.called:  # admitted, never sent: its request went away
                    if now - stream.admitted_at > UNSENT_S:
                        self._removed(stream)
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


class WatchStream(Response):
    media_type = MEDIA_TYPE

    def __init__(self, hub: Watchers, selector: Selector = ANY) -> None:
        super().__init__(
            None,
            headers={
                "cache-control": "no-store",
                "x-content-type-options": "nosniff",
                "transfer-encoding": "chunked",
            },
            media_type=MEDIA_TYPE,
        )
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.hub = hub
        self.selector = selector
        self.admitted_at = asyncio.get_running_loop().time()
        self.called = False  # the server started sending it
        self.start_at(hub.feed.progress)
        self.final: bytes | None = None
        self._cut: asyncio.Future[None] | None = None
        self.ended = False
        self._woken: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.live = False  # caught up and idle: the hub writes its lines directly
        self.last_write = 0.0

    def start_at(self, after: int) -> None:
        """Send the changes after revision ``after`` (the feed's, or a later one it skips to)."""
        feed = self.hub.feed
        self.epoch = feed.epoch
        self.revision = after  # every change up to here was sent (or skipped)
        self.position = feed.log.after(min(after, feed.progress))
        self._skip_until = after
        self.base = feed.log.end  # what came before it subscribed is not on its budget

    def compacted_line(self) -> bytes:
        log = self.hub.feed.log
        return error_line(
            self.revision,
            "revision_compacted",
            410,
            f"This stream fell out of the history this replica keeps (from revision "
            f"{log.oldest}): list the groups again and watch from the list's revision.",
            oldest_revision=log.oldest,
        )

    def finish(self, line: bytes, *, slow: bool = False) -> None:
        """End the stream with ``line``."""
        if self.ended:
            return
        self.ended = True
        self.final = line
        if slow:
            self.hub.metrics.watch_slow_consumers.inc()
        if self._cut is not None and not self._cut.done():
            self._cut.set_result(None)
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def direct(self, now: float) -> int | None:
        """The hub's fast path: the new lines written straight to the connection; how many
        (None: this stream must send on its own: behind, filtered from a later revision, or
        its connection's buffer is full)."""
        feed, log, transport = self.hub.feed, self.hub.feed.log, self.transport
        if transport is None or transport.is_closing():
            return None
        if transport.get_write_buffer_size() > DIRECT_BUFFER:
            return None
        if self.epoch != feed.epoch or self.position < log.offset:
            return None
        first = log.at(self.position)
        if first is None:
            self.revision = max(self.revision, feed.progress)
            return 0
        if first.revision <= self._skip_until or log.end - self.position > SHARED_EVENTS:
            return None
        _, framed, count, last = self.hub.chunk(self.position, self.selector)
        self.position = log.end
        self.revision = max(self.revision, last, feed.progress)
        if framed:
            transport.write(framed)
            self.last_write = now
        return count

    def _collect(self) -> tuple[bytes, int]:
        """The unsent events (whole revisions, up to about ``CHUNK_BYTES``)."""
        feed, log = self.hub.feed, self.hub.feed.log
        first = log.at(self.position)
        if (
            first is not None
            and first.revision > self._skip_until
            and log.end - self.position <= SHARED_EVENTS
        ):
            data, _, count, last = self.hub.chunk(self.position, self.selector)
            self.position = log.end
            self.revision = max(self.revision, last, feed.progress)
            return data, count
        parts: list[bytes] = []
        size = sent = 0
        while (event := log.at(self.position)) is not None:
            if size >= CHUNK_BYTES and event.revision != self.revision:
                return b"".join(parts), sent
            self.position += 1
            if event.revision <= self._skip_until:
                continue  # asked from a revision this replica had not reached yet
            self.revision = max(self.revision, event.revision)
            if (line := event.line_for(self.selector)) is not None:
                parts.append(line)
                size += len(line)
                sent += 1
        self.revision = max(self.revision, feed.progress)
        return b"".join(parts), sent

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        feed, metrics = self.hub.feed, self.hub.metrics
        self.last_write = loop.time()
        while True:
            if self.final is not None:
                await send({"type": "http.response.body", "body": self.final, "more_body": False})
                return
            if self.epoch != feed.epoch or self.position < feed.log.offset:
                self.finish(self.compacted_line())
                continue
            chunk, count = self._collect()
            now = loop.time()
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                metrics.watch_events_sent.inc(count)
                self.last_write = now
                if len(chunk) < CHUNK_BYTES:  # caught up: let the next changes gather
                    await asyncio.sleep(LINGER_S)
                continue
            if now - self.last_write >= self.hub.bookmark_s:
                line = b'{"type":"BOOKMARK","revision":%d,"object":null}\n' % self.revision
                await send({"type": "http.response.body", "body": line, "more_body": True})
                self.last_write = now
                continue
            # Caught up: the hub writes what comes next (or wakes this stream to send it).
            self._woken = loop.create_future()
            waits: set[asyncio.Future[None]] = {self._woken}
            if self.transport is None:  # no direct path on this server: follow the feed
                waits.add(feed.news())
            self.live = True
            try:
                await asyncio.wait(
                    waits,
                    timeout=self.hub.bookmark_s - (now - self.last_write),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                self.live = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.called = True
        self.hub._added(self)
        transport: asyncio.Transport | None = scope.get("extensions", {}).get(TRANSPORT)
        if transport is not None and (sock := transport.get_extra_info("socket")) is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self.transport = transport
        pump: asyncio.Task[None] | None = None
        gone: asyncio.Task[None] | None = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pump = asyncio.create_task(self._pump(send))
            gone = asyncio.create_task(_disconnected(receive))
            self._cut = asyncio.get_running_loop().create_future()
            if self.ended:
                self._cut.set_result(None)
            await asyncio.wait({pump, gone, self._cut}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()
                return
            # Ended (cut off, shutting down) or the consumer left: a second to take what is
            # on its way, then the connection is cut.
            if not gone.done():
                await asyncio.wait({pump, gone}, timeout=GRACE_S)
            if not pump.done() and transport is not None:
                transport.abort()
        finally:
            self.ended = True
            self.hub._removed(self)
            for task in (pump, gone):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
