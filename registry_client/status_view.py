"""``engine-registry status --watch``: the groups table redrawn in place, changes marked.

Plain ANSI (cursor home, clear to end of line and of screen), no curses. The groups come
from the registry's watch stream (``GET /tp-groups?watch=true``, read on a thread): one list,
then each change as it lands, no polling. A frame is drawn when changes arrive (at most one
per ``--interval``) and at least once per bookmark; a group whose row changed since the last
frame (role, generation, engine, ranks; not the ticking lease) is marked ``*``, a new one
``+``, and a group gone is listed below the table as ``-``. The stream is
`registry_client.client`'s watch (`RegistryClient.watch`, imported when it starts: ``app`` does not
import ``workers`` at import time), the one parser of it: a stream cut in the middle of a
revision that changed several groups resumes from just before it, so nothing is lost; a
``410`` lists again. When no registry answers for two intervals (or refuses the token), the
frame says so (and since when) and keeps the last table; the watch is taken up again from
where it was after a `registry_client.backoff.Backoff` pause (full jitter, 0.2 s growing to at most
max(5 s, ``--interval``)).
Ctrl-C ends it with the cursor restored and exit status 0, also when it was started with
SIGINT ignored (a background job of a non-interactive shell): it is a display a person ends
with Ctrl-C.
"""

from __future__ import annotations

import queue
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

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
    retry_s: float = 0.0  # the pause before the watch is taken up again
    _news: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)

    def client(self) -> Any:
        """A `registry_client.client.RegistryClient` on ``url`` with this watch's token and
        trust."""
        import httpx

        from registry_client.client import RegistryClient

        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        return RegistryClient(
            self.url,
            token=token,
            timeout_s=self.timeout_s,
            transport=httpx.HTTPTransport(verify=self.verify),
        )

    def follow(self) -> None:
        """On a thread: the client's watch (`RegistryClient.watch`: a list, then each change
        once, resumed mid-revision without loss, a relist on 410), put on ``_news`` for the
        drawing loop. A failure is shown and the same watch is taken up again after a
        `registry_client.backoff.Backoff` pause (at least a ``Retry-After`` the error carries)."""
        from registry_client.backoff import Backoff

        backoff = Backoff(base_s=0.2, cap_s=max(5.0, self.interval_s))
        # Unreachable on screen after two intervals with no word (at least 2 s); the watch
        # itself keeps its place (its cursor) across the pause.
        lost_after_s = max(2.0, 2 * self.interval_s)
        with self.client() as client:
            watch = client.watch(bookmarks=True, idle_timeout_s=30.0, lost_after_s=lost_after_s)
            while True:
                try:
                    for event in watch:
                        backoff.reset()
                        self._news.put(("event", event))
                    raise RuntimeError("the watch stream ended")
                except Exception as exc:  # shown on the frame; the watch is taken up again
                    self._news.put(("down", exc))
                    value = getattr(exc, "retry_after_s", None)
                    retry_after = float(value) if isinstance(value, int | float) else None
                    pause = backoff.next(retry_after)
                    self.retry_s = pause
                    time.sleep(pause)

    def take(self, wait_s: float) -> bool:
        """Apply what the stream brought (waiting up to ``wait_s`` for something); True when
        something came."""
        try:
            kind, item = self._news.get(timeout=wait_s)
        except queue.Empty:
            return False
        while True:
            if kind == "event":
                self.failure = None
                self.revision = item.revision
                if item.type == "SYNC":
                    self.groups = {e.group_id: e.raw for e in item.groups}
                elif item.type == "DELETED" and item.engine is not None:
                    self.groups.pop(item.engine.group_id, None)
                elif item.engine is not None:
                    self.groups[item.engine.group_id] = item.engine.raw
            else:
                self.failure = item
            try:
                kind, item = self._news.get_nowait()
            except queue.Empty:
                return True

    def frame(self, now: float) -> str:
        """One frame's text: the groups as the stream has them, compared with the last frame."""
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        # Before the first list there is no revision to show: say it is still connecting.
        state = "connecting" if self.revision is None else f"watching (revision {self.revision})"
        head = f"engine-registry status  {self.url}  {state}  {stamp}"
        if self.failure is not None:
            exc = self.failure
            if self.down_since is None:
                self.down_since = now
            since = time.strftime("%H:%M:%S", time.localtime(self.down_since))
            alert = (
                f"REGISTRY UNREACHABLE since {since}: {type(exc).__name__}: {exc}; "
                f"retrying in {self.retry_s:.1f}s (the table below is from before)"
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
