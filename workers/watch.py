"""Watching the registry's groups (``GET /tp-groups?watch=true``, docs/api.md "Watching"):
a synchronous and an asynchronous iterator of changes, on a `RegistryClient`'s replicas.

Policy, in one place:

- It starts with a list (every group, in pages) and yields it as one ``SYNC`` event, then
  every change after the list's revision (``ADDED``, ``MODIFIED``, ``DELETED``), each once,
  in order. Started at a ``revision``, it skips the list.
- A broken stream (a replica killed, restarted or shutting down, a read past
  ``idle_timeout_s`` with no line: the server sends a bookmark every few seconds) resumes at
  the last revision it delivered, on the next replica: nothing is lost or repeated (a
  revision that changed several groups is resumed from just before it, and the groups
  already yielded at it are skipped).
- ``410 revision_compacted`` (the revision is older than the history kept) lists again and
  yields a new ``SYNC``: replace what you knew with it.
- A refusal that retrying cannot fix (401, 403, 422) raises its `ProblemError` at once.
- Nothing heard from any replica for ``lost_after_s`` (no line, no answer) raises
  `WatchLost` (a `RegistryUnavailable`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx

from workers.errors import ProblemError, RevisionCompacted, WatchLost, problem_class
from workers.models import Engine

if TYPE_CHECKING:
    from workers.client import RegistryClient

EventType = Literal["SYNC", "ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
PAGE = 500
# Codes of a stream's final ERROR line after which another replica (or the same one, later)
# serves the watch on from its revision.
_RESUMABLE = {"shutting_down", "slow_consumer", "too_many_watchers", "store_unavailable"}


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    revision: int
    engine: Engine | None = None  # ADDED, MODIFIED, DELETED: the group's engine
    groups: list[Engine] = field(default_factory=list)  # SYNC: every group at `revision`


class _Relist(Exception):
    pass


class _Resume(Exception):
    pass


class Cursor:
    """Where a watch stands: every change up to ``done`` was delivered, and at ``current``
    (above it) the groups in ``seen``."""

    def __init__(self, revision: int) -> None:
        self.done = revision
        self.current = 0
        self.seen: set[str] = set()

    @property
    def resume_from(self) -> int:
        return self.current - 1 if self.seen else self.done

    def accept(self, line: dict[str, Any]) -> WatchEvent | None:
        """The event to deliver for a stream line (None: a duplicate); raises on ERROR."""
        kind, revision = str(line["type"]), int(line["revision"])
        if kind == "ERROR":
            problem = line.get("object") or {}
            if problem.get("code") == "revision_compacted":
                raise _Relist()
            raise _Resume(str(problem.get("code")))
        if kind == "BOOKMARK":
            if revision >= self.done:
                self.done = revision
                if self.current <= revision:
                    self.current, self.seen = 0, set()
            return WatchEvent("BOOKMARK", revision)
        engine = Engine.from_json(line["object"])
        if revision <= self.done or (revision == self.current and engine.group_id in self.seen):
            return None
        if revision > self.current:
            if self.seen:
                self.done = self.current
            self.current, self.seen = revision, set()
        self.seen.add(engine.group_id)
        return WatchEvent(kind, revision, engine)  # type: ignore[arg-type]


class _Watch:
    def __init__(
        self,
        client: RegistryClient,
        *,
        revision: int | None,
        role: str | None,
        bookmarks: bool,
        idle_timeout_s: float,
        lost_after_s: float,
    ) -> None:
        self.client = client
        self.cursor = None if revision is None else Cursor(revision)
        self.role = role
        self.bookmarks = bookmarks
        self.idle_timeout_s = idle_timeout_s
        self.lost_after_s = lost_after_s
        self.url_index = 0
        self.heard = time.monotonic()
        self.failures: list[str] = []

    def params(self, cursor: Cursor) -> dict[str, Any]:
        params: dict[str, Any] = {"watch": "true", "revision": cursor.resume_from}
        return params | ({"role": self.role} if self.role else {})

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.idle_timeout_s, connect=self.client.connect_timeout_s)

    def failed(self, why: str) -> None:
        """A replica failed this watch: the next one serves it; lost past the deadline."""
        self.failures.append(f"{self.client.urls[self.url_index]}: {why}")
        self.url_index = (self.url_index + 1) % len(self.client.urls)
        if time.monotonic() - self.heard > self.lost_after_s:
            raise WatchLost(
                f"watch: no registry answered for {self.lost_after_s:g} s (tried "
                f"{', '.join(self.client.urls)}; last: {'; '.join(self.failures[-3:])})",
                urls=list(self.client.urls),
                attempts=len(self.failures),
            )

    def pause(self) -> float:
        """After a full round of failures, a short wait before the next."""
        return min(1.0, 0.1 * len(self.failures)) if self.url_index == 0 else 0.0

    def check(self, response: httpx.Response, body: bytes) -> None:
        """An error answer to the watch request: relist, resume elsewhere, or raise."""
        try:
            problem = json.loads(body)
        except ValueError:
            problem = {"detail": body[:500].decode("utf-8", "replace")}
        if not isinstance(problem, dict):
            problem = {"detail": str(problem)}
        cls = problem_class(response.status_code, problem)
        if cls is RevisionCompacted:
            raise _Relist()
        if response.status_code >= 500:
            raise _Resume(f"{response.status_code} {problem.get('code', '')}")
        raise cls(problem, status=response.status_code, url=str(response.url))

    def handle(self, raw: str) -> WatchEvent | None:
        assert self.cursor is not None
        self.heard = time.monotonic()
        self.failures.clear()
        event = self.cursor.accept(json.loads(raw))
        if event is not None and event.type == "BOOKMARK" and not self.bookmarks:
            return None
        return event

    def synced(self, body: dict[str, Any], groups: list[Engine]) -> WatchEvent:
        revision = int(body["revision"])
        self.cursor = Cursor(revision)
        self.heard = time.monotonic()
        return WatchEvent("SYNC", revision, groups=groups)


class GroupWatch(_Watch):
    """The synchronous watch (see the module doc): ``for event in client.watch(): ...``."""

    def _list(self) -> WatchEvent:
        groups: list[Engine] = []
        params: dict[str, Any] = {"limit": PAGE} | ({"role": self.role} if self.role else {})
        while True:
            try:
                body = self.client.request("GET", "/tp-groups", params=params).json()
            except RevisionCompacted:  # the walk outlived the history: from the start
                groups, params = [], {k: v for k, v in params.items() if k != "continue"}
                continue
            groups += [Engine.from_json(g) for g in body["groups"]]
            if body.get("continue") is None:
                return self.synced(body, groups)
            params["continue"] = body["continue"]

    def __iter__(self) -> Iterator[WatchEvent]:
        http = self.client._http
        if self.cursor is None:
            yield self._list()
        while True:
            assert self.cursor is not None
            url = self.client.urls[self.url_index]
            try:
                with http.stream(
                    "GET", url + "/tp-groups", params=self.params(self.cursor),
                    timeout=self.timeout(),
                ) as response:  # fmt: skip
                    if response.status_code != 200:
                        self.check(response, response.read())
                    self.heard = time.monotonic()
                    for raw in response.iter_lines():
                        if raw and (event := self.handle(raw)) is not None:
                            yield event
                self.failed("the stream ended")
            except _Relist:
                yield self._list()
            except _Resume as exc:
                self.failed(str(exc))
            except httpx.TransportError as exc:
                self.failed(repr(exc))
            time.sleep(self.pause())


class AsyncGroupWatch(_Watch):
    """The asynchronous watch: ``async for event in client.awatch(): ...`` (its own
    ``httpx.AsyncClient`` with the client's token and TLS)."""

    async def _list(self, http: httpx.AsyncClient) -> WatchEvent:
        groups: list[Engine] = []
        params: dict[str, Any] = {"limit": PAGE} | ({"role": self.role} if self.role else {})
        while True:
            url = self.client.urls[self.url_index]
            try:
                response = await http.get(url + "/tp-groups", params=params, timeout=self.timeout())
                if response.status_code != 200:
                    self.check(response, response.content)
            except _Relist:
                groups, params = [], {k: v for k, v in params.items() if k != "continue"}
                continue
            except (_Resume, httpx.TransportError) as exc:
                self.failed(str(exc) or repr(exc))
                await asyncio.sleep(self.pause())
                continue
            body = response.json()
            groups += [Engine.from_json(g) for g in body["groups"]]
            if body.get("continue") is None:
                return self.synced(body, groups)
            params["continue"] = body["continue"]

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        async with httpx.AsyncClient(
            headers=self.client._http.headers, trust_env=False, verify=self.client.tls.context
        ) as http:
            if self.cursor is None:
                yield await self._list(http)
            while True:
                assert self.cursor is not None
                url = self.client.urls[self.url_index]
                try:
                    async with http.stream(
                        "GET", url + "/tp-groups", params=self.params(self.cursor),
                        timeout=self.timeout(),
                    ) as response:  # fmt: skip
                        if response.status_code != 200:
                            self.check(response, await response.aread())
                        self.heard = time.monotonic()
                        async for raw in response.aiter_lines():
                            if raw and (event := self.handle(raw)) is not None:
                                yield event
                    self.failed("the stream ended")
                except _Relist:
                    yield await self._list(http)
                except _Resume as exc:
                    self.failed(str(exc))
                except httpx.TransportError as exc:
                    self.failed(repr(exc))
                await asyncio.sleep(self.pause())


__all__ = ["AsyncGroupWatch", "Cursor", "GroupWatch", "ProblemError", "WatchEvent", "WatchLost"]
