"""Watch streams read in a thread, for tests: raw lines (`WatchLines`) or the workers' client
(`ClientWatch`); every wait has a deadline."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx

from registry_client.client import RegistryClient
from registry_client.watch import WatchEvent


class WatchLines:
    """``GET /tp-groups?watch=true...`` on ``client``; lines parsed as they come."""

    def __init__(self, client: httpx.Client, params: dict[str, Any], **kw: Any) -> None:
        self.lines: queue.Queue[dict[str, Any] | BaseException | None] = queue.Queue()
        self._cm = client.stream(
            "GET", "/tp-groups", params={"watch": "true", **params}, timeout=30.0, **kw
        )
        self.response = self._cm.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        if self.response.status_code == 200:
            self._thread.start()
        else:
            self.response.read()

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines():
                if line:
                    self.lines.put(json.loads(line))
            self.lines.put(None)
        except BaseException as exc:  # closed under it, or broken: the reader sees it
            self.lines.put(exc)

    def next(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The next line (None: the stream ended); fails past ``timeout_s``."""
        item = self.lines.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def changes(self, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The next ``n`` lines that are not bookmarks."""
        deadline = time.monotonic() + timeout_s
        out: list[dict[str, Any]] = []
        while len(out) < n:
            line = self.next(max(0.01, deadline - time.monotonic()))
            assert line is not None, f"the stream ended after {out}"
            if line["type"] != "BOOKMARK":
                out.append(line)
        return out

    def close(self) -> None:
        self.response.close()
        self._cm.__exit__(None, None, None)
        self._thread.join(timeout=5)

    def __enter__(self) -> WatchLines:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ClientWatch:
    """``client.watch(**kw)`` iterated on a thread; its events kept."""

    def __init__(self, client: RegistryClient, **kw: Any) -> None:
        self.events: list[WatchEvent] = []
        self.error: BaseException | None = None
        self._watch = client.watch(**kw)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._watch:
                self.events.append(event)
        except BaseException as exc:  # the client closed under it at the end, or a failure
            self.error = exc

    def syncs(self) -> int:
        return sum(e.type == "SYNC" for e in self.events)

    def added(self) -> list[str]:
        return [e.engine.group_id for e in self.events if e.engine is not None]

    def changes(self) -> list[tuple[int, str, str]]:
        return [
            (e.revision, e.engine.group_id, e.type) for e in self.events if e.engine is not None
        ]

    def seen(self) -> set[str]:
        """The groups in its events: changes, and lists (``SYNC``)."""
        return {g.group_id for e in self.events for g in e.groups} | set(self.added())

    def wait(self, done: Callable[[], object], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.error is None, f"the watch failed: {self.error!r}"
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s: {self.events}"
            time.sleep(0.02)

    def wait_for(self, group: str, timeout_s: float) -> None:
        self.wait(lambda: group in self.seen(), timeout_s, f"{group} seen")
