"""Many decode nodes' registry streams in one process (``bench/decoders.py`` starts a few).

Each stream asks what one node's leader asks (`workers.vllm_plugin.node_follow`):
``GET /tp-groups?watch=true&revision=N&model=M`` (``role`` too when given), kept by
`registry_client.watch.Cursor` (a repeated line is dropped and counted), resumed after a failure at
the cursor's revision on the next URL after a pause of `registry_client.backoff.Backoff` with the
node leader's watch settings (full jitter, the first pause in ``[0, WATCH_BASE_S)``), and on
``410`` listed again (pages of 500, the same filter) before watching from the list's revision.

Streams are raw asyncio protocols (a chunked ndjson reader, no HTTP library: aiohttp and
httpx cost tens of microseconds a line, and a relaunch is one line on every stream at once).
Only the lines of groups whose id starts with ``--prefix`` (the writer's) are recorded.

Driven over stdin, one command a line, each answered with one JSON line on stdout:
``mark`` (CPU seconds, loop lag since the last mark), ``wait {"gid": gen, ...} TIMEOUT``
(until every stream knows at least those generations), ``dump PATH`` (the records).
EOF ends it. The first line out is ``{"ready": streams open, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import aiohttp

from bench.common import summary_ms
from registry_client.backoff import Backoff, retry_after
from registry_client.watch import PAGE, Cursor
from workers.vllm_plugin.node_follow import WATCH_BASE_S, WATCH_CAP_S

RELIST_CODES = {"revision_compacted", "revision_ahead"}
CONNECTS_IN_FLIGHT = 256


class _Conn(asyncio.Protocol):
    """One watch request on its own connection: the head, then chunked lines."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.head: bytes | None = None
        self.status = 0
        self.lines = bytearray()
        self.done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = bytes(self.buf[:end]).lower()
            self.status = int(self.buf[9:12])
            del self.buf[: end + 4]
            if self.status == 200:
                self.stream.opened()
        if self.status != 200:
            at = self.head.find(b"content-length:")
            length = int(self.head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) >= length and not self.done.done():
                self.done.set_result((self.status, bytes(self.buf[:length])))
            return
        while True:  # chunks: "<hex size>\r\n<data>\r\n"
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(self.buf[:eol], 16)
            if size == 0:
                if not self.done.done():
                    self.done.set_result((200, b""))
                return
            if len(self.buf) < eol + 2 + size + 2:
                return
            self.lines += self.buf[eol + 2 : eol + 2 + size]
            del self.buf[: eol + 2 + size + 2]
            *whole, rest = self.lines.split(b"\n")
            self.lines = bytearray(rest)
            for line in whole:
                if line:
                    self.stream.line(line)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result((self.status, b""))


class Stream:
    """One node's watch, resumed as the plugin's leader resumes it."""

    def __init__(self, shared: Shared, revision: int) -> None:
        self.shared = shared
        self.cursor = Cursor(revision)
        self.backoff = Backoff(base_s=WATCH_BASE_S, cap_s=WATCH_CAP_S)
        self.url_index = 0
        self.known: dict[str, int] = {}  # the writer's groups: the newest generation known
        self.records: list[list[Any]] = []  # [t, kind, revision, gid, generation]
        self.opens: list[float] = []  # each 200
        self.failed = False
        self.code = ""  # the last ERROR line's code
        self.heard = False

    def opened(self) -> None:
        self.opens.append(time.monotonic())
        self.failed = False
        self.shared.open += 1
        if self.shared.open >= self.shared.target:
            self.shared.all_open.set()

    def line(self, raw: bytes | bytearray) -> None:
        self.shared.lines += 1
        line = json.loads(raw)
        kind = line["type"]
        if kind == "ERROR":
            self.code = str((line.get("object") or {}).get("code"))
            if self.shared.at_error and self.code not in RELIST_CODES:
                # its revision is the last one fully sent (docs/api.md): resume from it
                self.cursor.accept({"type": "BOOKMARK", "revision": line["revision"]})
            return
        if not self.heard:
            self.heard = True
            self.backoff.reset()
        event = self.cursor.accept(line)
        if kind == "BOOKMARK":
            return
        if event is None:
            self.shared.duplicates += 1
            return
        assert event.engine is not None
        gid = event.engine.group_id
        if gid.startswith(self.shared.prefix):
            gen = event.engine.generation
            self.records.append([time.monotonic(), kind[0], event.revision, gid, gen])
            self.known[gid] = max(gen, self.known.get(gid, 0))

    async def run(self) -> None:
        shared = self.shared
        loop = asyncio.get_running_loop()
        pause = 0.0
        while True:
            await asyncio.sleep(pause)
            url = shared.urls[self.url_index]
            host, port = url.removeprefix("http://").rsplit(":", 1)
            query = {"watch": "true", "revision": self.cursor.resume_from} | shared.filters
            request = f"GET /tp-groups?{urlencode(query)} HTTP/1.1\r\nhost: r\r\n\r\n"
            floor = None
            self.code, self.heard = "", False
            if self.failed:
                shared.attempts.append(time.monotonic())
            try:
                async with shared.gate:
                    _, conn = await loop.create_connection(lambda: _Conn(self), host, int(port))
                assert conn.transport is not None
                conn.transport.write(request.encode())
                status, body = await conn.done
                conn.transport.close()
                if conn.status == 200:
                    shared.open -= 1
                code = self.code or _code(body)
                floor = retry_after(_header(conn.head, b"retry-after:"))
            except OSError as exc:
                status, code = 0, type(exc).__name__
            shared.ends[f"{status} {code}"] = shared.ends.get(f"{status} {code}", 0) + 1
            if code in RELIST_CODES:
                try:
                    await self.relist(url)
                    pause = 0.0
                    continue
                except (OSError, RuntimeError, ValueError) as exc:
                    code = f"relist failed: {exc!r}"[:80]
                    shared.ends[code] = shared.ends.get(code, 0) + 1
            self.failed = True
            self.url_index = (self.url_index + 1) % len(shared.urls)
            pause = self.backoff.next(floor)

    async def relist(self, url: str) -> None:
        """The filtered list, page by page; its revision is where the watch goes on."""
        shared = self.shared
        params: dict[str, Any] = {"limit": PAGE} | shared.filters
        synced: dict[str, int] = {}
        while True:
            async with shared.session().get(f"{url}/tp-groups", params=params) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"relist: {answer.status} {await answer.text()}")
                body = await answer.json()
            for g in body["groups"]:
                if g["group_id"].startswith(shared.prefix):
                    synced[g["group_id"]] = int(g["generation"])
            if body.get("continue") is None:
                break
            params["continue"] = body["continue"]
        shared.relists += 1
        self.cursor = Cursor(int(body["revision"]))
        now = time.monotonic()
        for gid, gen in synced.items():
            self.records.append([now, "S", int(body["revision"]), gid, gen])
            self.known[gid] = max(gen, self.known.get(gid, 0))


def _code(body: bytes) -> str:
    try:
        problem = json.loads(body) if body else {}
    except ValueError:
        return body[:60].decode(errors="replace")
    return str(problem.get("code", "")) if isinstance(problem, dict) else ""


def _header(head: bytes | None, name: bytes) -> str | None:
    at = (head or b"").find(name)
    if head is None or at < 0:
        return None
    return head[at + len(name) :].split(b"\r\n", 1)[0].decode().strip()


class Shared:
    def __init__(self, urls: list[str], filters: dict[str, str], prefix: str) -> None:
        self.urls, self.filters, self.prefix = urls, filters, prefix
        self.gate = asyncio.Semaphore(CONNECTS_IN_FLIGHT)
        self.all_open = asyncio.Event()
        self.target = 1 << 30
        self.at_error = False  # resume from an ERROR line's revision (not the plugin's way)
        self.open = self.lines = self.duplicates = self.relists = 0
        self.attempts: list[float] = []
        self.ends: dict[str, int] = {}
        self.lags: list[float] = []
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """For relists (rare; answers of any size): at most 8 at once."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8))
        return self._session


async def _ticker(shared: Shared) -> None:
    """The loop's own lag: how late a 50 ms sleep wakes."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.05)
        shared.lags.append(time.monotonic() - t - 0.05)


async def _wait(streams: list[Stream], want: dict[str, int], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        behind = sum(any(s.known.get(g, 0) < n for g, n in want.items()) for s in streams)
        if not behind or time.monotonic() > deadline:
            return {"ok": not behind, "behind": behind}
        await asyncio.sleep(0.05)


async def main_async(args: argparse.Namespace) -> None:
    filters = {"model": args.model} | ({"role": args.role} if args.role else {})
    shared = Shared(args.urls.split(","), filters, args.prefix)
    shared.at_error = args.resume_at_error
    streams = [Stream(shared, args.revision) for _ in range(args.streams)]
    tasks = [asyncio.create_task(s.run()) for s in streams]
    tasks.append(asyncio.create_task(_ticker(shared)))
    shared.target = len(streams)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(shared.all_open.wait(), args.ready_timeout)
    _say({"ready": shared.open, "streams": len(streams), "ends": shared.ends})
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "mark":
            lags, shared.lags = shared.lags, []
            _say(
                {
                    "cpu_s": time.process_time(),
                    "lag": summary_ms(lags),
                    "open": shared.open,
                    "lines": shared.lines,
                }
            )
        elif cmd == "wait":
            want, _, timeout = rest.rpartition(" ")
            _say(await _wait(streams, json.loads(want), float(timeout)))
        elif cmd == "dump":
            data = {
                "records": [s.records for s in streams],
                "opens": [s.opens for s in streams],
                "attempts": shared.attempts,
                "ends": shared.ends,
                "duplicates": shared.duplicates,
                "relists": shared.relists,
                "lines": shared.lines,
                "open": shared.open,
            }
            await asyncio.to_thread(Path(rest).write_text, json.dumps(data))
            _say({"dumped": rest})
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if shared._session is not None:
        await shared._session.close()


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decoder_streams", description=__doc__)
    parser.add_argument("--urls", required=True, help="registry URLs, comma-separated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--role", default="")
    parser.add_argument("--revision", type=int, required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--prefix", required=True, help="record groups whose id starts so")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument(
        "--resume-at-error",
        action="store_true",
        help="resume from a final ERROR line's revision (registry_client.watch resumes from the "
        "last "
        "event's revision minus one)",
    )
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
