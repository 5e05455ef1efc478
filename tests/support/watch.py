"""A watch stream read line by line in a thread, for tests: every wait has a deadline."""

from __future__ import annotations

import json
import queue
import threading
import time
from types import TracebackType
from typing import Any

import httpx


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
