"""``engine-registry status --watch``: the groups table redrawn in place, changes marked.

Plain ANSI (cursor home, clear to end of line and of screen), no curses. Each frame is one
``GET /tp-groups`` with a deadline; a group whose row changed since the last frame (role,
generation, engine, ranks; not the ticking lease) is marked ``*``, a new one ``+``, and a
group gone is listed below the table as ``-``. When the registry does not answer, the frame
says so (and since when), keeps the last table, and the next frame tries again. Ctrl-C ends it
with the cursor restored and exit status 0, also when it was started with SIGINT ignored
(a background job of a non-interactive shell): it is a display a person ends with Ctrl-C.
"""

from __future__ import annotations

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

    def fetch(self) -> list[dict[str, Any]]:
        answer = httpx.get(
            f"{self.url.rstrip('/')}/tp-groups",
            headers=self.headers,
            timeout=self.timeout_s,
            verify=self.verify,
        )
        if answer.status_code != 200:
            raise RuntimeError(f"answered {answer.status_code}: {answer.text[:200]}")
        groups: list[dict[str, Any]] = answer.json()["groups"]
        return groups

    def frame(self, now: float) -> str:
        """One frame's text: fetch, compare with the last frame, lay out."""
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        head = f"engine-registry status  {self.url}  every {self.interval_s:g}s  {stamp}"
        try:
            groups = self.fetch()
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
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
        try:
            while True:
                started = time.monotonic()
                self.draw(self.frame(time.time()))
                time.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        except KeyboardInterrupt:
            return 0
        finally:
            self.out.write(SHOW_CURSOR + "\n")
            self.out.flush()


def _take_ctrl_c() -> None:
    """SIGINT raises KeyboardInterrupt, even when the watch inherited it ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
