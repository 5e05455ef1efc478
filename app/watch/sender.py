"""One watch stream's response (``GET /tp-groups?watch=true``): its place in the feed's log,
what it writes and when. The hub that admits streams, watches their budgets, writes caught-up
streams' lines at once and ends them is `app.watch.stream.Watchers`.

A stream writes what it has not sent, whole revisions at a time, in chunks of up to
``CHUNK_BYTES``, then waits: the hub writes the next lines itself (``direct``) while the
connection keeps up, or wakes the stream to send them. Ended (``finish``), it sends its final
``ERROR`` line; a consumer that does not take it within ``GRACE_S`` is cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.core.metrics import Metrics
from app.core.problems import error_line
from app.watch.feed import Feed
from app.watch.history import ANY, Selector

MEDIA_TYPE = "application/x-ndjson"
CHUNK_BYTES = 256 * 1024
GRACE_S = 1.0  # a cut-off consumer's time to read what is on its way
# After a write, changes gather this long before the next one: a storm's go out as one write
# per stream per LINGER_S, not one per change (which cost the storm a quarter of its rate at
# 100 watchers); a lone change goes out at once.
LINGER_S = 0.05
SHARED_EVENTS = 256  # a caught-up watcher's next events come from the hub's shared chunk
DIRECT_BUFFER = 64 * 1024  # a connection holding more unsent bytes sends on its own
# scope["extensions"]: the connection's asyncio transport (app/server/protocol.py puts it there)
TRANSPORT = "engine_registry.transport"
# A watch connection's kernel send buffer (Linux doubles it), not the few MB it may grow to.
SNDBUF = 64 * 1024


class Hub(Protocol):
    """What a stream reads of its hub (`app.watch.stream.Watchers`)."""

    feed: Feed
    metrics: Metrics
    bookmark_s: float

    def chunk(self, start: int, selector: Selector) -> tuple[bytes, bytes, int, int]: ...

    def added(self, stream: WatchStream) -> None: ...

    def removed(self, stream: WatchStream) -> None: ...


class WatchStream(Response):
    media_type = MEDIA_TYPE

    def __init__(self, hub: Hub, selector: Selector = ANY) -> None:
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
        self.sending = False  # a write waits for the connection to take it
        self.drain_by: float | None = None  # SIGTERM: sending what the log holds until then

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

    def shutting_down_line(self) -> bytes:
        return error_line(
            self.revision,
            "shutting_down",
            503,
            "This replica is shutting down: watch another one from this revision.",
        )

    def drain(self, deadline: float) -> None:
        """SIGTERM: send what the log holds, until ``deadline``, then end; a connection that
        is not taking what it was sent already ends now."""
        transport = self.transport
        stalled = self.sending or (
            transport is not None
            and (transport.is_closing() or transport.get_write_buffer_size() > DIRECT_BUFFER)
        )
        if stalled:
            self.finish(self.shutting_down_line())
            return
        self.drain_by = deadline
        self.wake()

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
            if self.drain_by is not None and loop.time() >= self.drain_by:
                self.finish(self.shutting_down_line())
                continue
            chunk, count = self._collect()
            now = loop.time()
            if chunk:
                self.sending = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sending = False
                metrics.watch_events_sent.inc(count)
                self.last_write = now
                if self.drain_by is None and len(chunk) < CHUNK_BYTES:
                    await asyncio.sleep(LINGER_S)  # caught up: let the next changes gather
                continue
            if self.drain_by is not None:  # all sent: ends at the revision it reached
                self.finish(self.shutting_down_line())
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
        self.hub.added(self)
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
            self.hub.removed(self)
            for task in (pump, gone):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
