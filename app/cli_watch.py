"""``engine-registry status --watch``: the groups table redrawn in place, changes marked.

Plain ANSI (cursor home, clear to end of line and of screen), no curses. The groups come
from the registry's watch stream (``GET /tp-groups?watch=true``, read on a thread): one list,
then each change as it lands, no polling. A frame is drawn when changes arrive (at most one
per ``--interval``) and at least once per bookmark; a group whose row changed since the last
frame (role, generation, engine, ranks; not the ticking lease) is marked ``*``, a new one
``+``, and a group gone is listed below the table as ``-``. When the registry does not answer
(or the stream breaks), the frame says so (and since when), keeps the last table, and the
stream is opened again every ``--interval`` from its last revision (a ``410`` lists again).
Ctrl-C ends it with the cursor restored and exit status 0, also when it was started with
SIGINT ignored (a background job of a non-interactive shell): it is a display a person ends
with Ctrl-C.
"""

from __future__ import annotations

import json
import queue
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

HOME, CLEAR_LINE, CLEAR_DOWN = "\x1b[H", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BOLD, RED, RESET = "\x1b[1m", "\x1b[31m", "\x1b[0m"


def _key(group: dict[str, Any]) -> tuple[Any, ...]:
    return (
        group["role"],
        group["generation"],
        group["engine_id"],
        tuple(group["registered_ranks"]),
        tuple(group["missing_ranks"]),
        tuple(a.get("host") for a in group.get("agents") or []),
    )


@dataclass
class Watch:
    url: str
    headers: dict[str, str]
    interval_s: float
    timeout_s: float
    format_groups: Callable[[list[dict[str, Any]]], str]
    out: TextIO = field(default_factory=lambda: sys.stdout)
    color: bool = False
    verify: ssl.SSLContext | bool = True  # an https:// registry's trust (app.cli's --ca, ...)
    last: dict[str, tuple[Any, ...]] | None = None
    table: list[str] = field(default_factory=list)
    down_since: float | None = None

    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    revision: int | None = None
    failure: Exception | None = None
    _news: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)

    def fetch(self) -> tuple[list[dict[str, Any]], int]:
        answer = httpx.get(
            f"{self.url.rstrip('/')}/tp-groups",
            headers=self.headers,
            timeout=self.timeout_s,
            verify=self.verify,
        )
        if answer.status_code != 200:
            raise RuntimeError(f"answered {answer.status_code}: {answer.text[:200]}")
        body = answer.json()
        return body["groups"], int(body.get("revision", 0))

    def follow(self) -> None:
        """On a thread: list, then the watch stream from the list's revision; what comes is
        put on ``_news`` for the drawing loop. A broken stream is opened again (from its
        revision) every ``interval_s``; a 410 lists again."""
        revision: int | None = None
        while True:
            try:
                if revision is None:
                    groups, revision = self.fetch()
                    self._news.put(("list", (groups, revision)))
                params: dict[str, str | int] = {"watch": "true", "revision": revision}
                timeout = httpx.Timeout(60.0, connect=self.timeout_s)
                with httpx.stream(
                    "GET", f"{self.url.rstrip('/')}/tp-groups", params=params,
                    headers=self.headers, timeout=timeout, verify=self.verify,
                ) as answer:  # fmt: skip
                    if answer.status_code == 410:
                        revision = None
                        continue
                    if answer.status_code != 200:
                        raise RuntimeError(f"answered {answer.status_code}")
                    self._news.put(("up", None))
                    for raw in answer.iter_lines():
                        if not raw:
                            continue
                        line = json.loads(raw)
                        if line["type"] == "ERROR":
                            if line["object"].get("code") == "revision_compacted":
                                revision = None
                            raise RuntimeError(str(line["object"].get("detail", "")))
                        revision = max(revision or 0, int(line["revision"]))
                        self._news.put(("line", line))
                raise RuntimeError("the watch stream ended")
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                self._news.put(("down", exc))
                time.sleep(self.interval_s)

    def take(self, wait_s: float) -> bool:
        """Apply what the stream brought (waiting up to ``wait_s`` for something); True when
        something came."""
        try:
            kind, item = self._news.get(timeout=wait_s)
        except queue.Empty:
            return False
        while True:
            if kind == "list":
                groups, self.revision = item
                self.groups = {str(g["group_id"]): g for g in groups}
                self.failure = None
            elif kind == "line":
                self.failure = None
                self.revision = int(item["revision"])
                engine = item.get("object")
                if item["type"] == "DELETED":
                    self.groups.pop(str(engine["group_id"]), None)
                elif item["type"] in ("ADDED", "MODIFIED"):
                    self.groups[str(engine["group_id"])] = engine
            elif kind == "up":
                self.failure = None
            else:
                self.failure = item
            try:
                kind, item = self._news.get_nowait()
            except queue.Empty:
                return True

    def frame(self, now: float) -> str:
        """One frame's text: the groups as the stream has them, compared with the last frame."""
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        head = f"engine-registry status  {self.url}  watching (revision {self.revision})  {stamp}"
        if self.failure is not None:
            exc = self.failure
            if self.down_since is None:
                self.down_since = now
            since = time.strftime("%H:%M:%S", time.localtime(self.down_since))
            alert = (
                f"REGISTRY UNREACHABLE since {since}: {type(exc).__name__}: {exc}; "
                f"retrying every {self.interval_s:g}s (the table below is from before)"
            )
            if self.color:
                alert = f"{RED}{BOLD}{alert}{RESET}"
            return "\n".join([head, alert, *self.table])
        groups = list(self.groups.values())
        self.down_since = None
        ordered = sorted(groups, key=lambda g: str(g["group_id"]))
        keys = {str(g["group_id"]): _key(g) for g in ordered}
        lines = self.format_groups(ordered).split("\n") if ordered else ["no groups"]
        marked = [f"  {lines[0]}"]
        changed = 0
        for g, line in zip(ordered, lines[1:], strict=True):
            gid = str(g["group_id"])
            mark = " "
            if self.last is not None and gid not in self.last:
                mark = "+"
            elif self.last is not None and self.last[gid] != keys[gid]:
                mark = "*"
            if mark != " ":
                changed += 1
                if self.color:
                    line = f"{BOLD}{line}{RESET}"
            marked.append(f"{mark} {line}")
        gone = sorted(set(self.last or {}) - set(keys))
        marked.extend(f"- {gid} (gone)" for gid in gone)
        ready = sum(bool(g["ready"]) for g in groups)
        summary = (
            f"{len(groups)} groups, {ready} ready; {changed} changed, {len(gone)} gone "
            "since the last frame (* changed, + new, - gone)"
        )
        self.last = keys
        self.table = marked
        return "\n".join([head, summary, *marked])

    def draw(self, text: str) -> None:
        body = "".join(f"{line}{CLEAR_LINE}\n" for line in text.split("\n"))
        self.out.write(f"{HOME}{body}{CLEAR_DOWN}")
        self.out.flush()

    def run(self) -> int:
        _take_ctrl_c()
        self.out.write(HIDE_CURSOR + "\x1b[2J")
        threading.Thread(target=self.follow, name="status-watch", daemon=True).start()
        try:
            self.take(self.timeout_s)  # the first list, or why there is none
            while True:
                started = time.monotonic()
                self.draw(self.frame(time.time()))
                # At most one frame per interval; the next when something comes.
                time.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
                self.take(30.0)
        except KeyboardInterrupt:
            return 0
        finally:
            self.out.write(SHOW_CURSOR + "\n")
            self.out.flush()


def _take_ctrl_c() -> None:
    """SIGINT raises KeyboardInterrupt, even when the watch inherited it ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
