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
- ``410 revision_compacted`` (the revision is older than the history kept) and
  ``410 revision_ahead`` (the revision is beyond the store's: a store restored from a backup,
  a registry restarted on a fresh file) list again and yield a new ``SYNC``: replace what you
  knew with it.
- Between tries, a pause of the one back-off policy (`registry_client.backoff.Backoff`: capped
  exponential, full jitter, a server's ``Retry-After`` as a floor), the first try after a
  failure included: watchers that lost the same replica come back spread over the window,
  not in the same second. A line heard resets it.
- ``role`` and ``model`` (the engine's ``compat["model"]``) filter on the server: a group
  that enters the filter comes as ``ADDED``, one that leaves it as ``DELETED``.
- A replica that answers the watch again after failures is logged (INFO, logger
  ``registry_client.watch``): where, from which revision, after how many tries and how long
  unheard, so a consumer's log says when it was blind.
- A refusal that retrying cannot fix (401, 403, 422) raises its `ProblemError` at once.
- Nothing heard from any replica for ``lost_after_s`` (no line, no answer) raises
  `WatchLost` (a `RegistryUnavailable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from registry_client.backoff import Backoff, retry_after
from registry_client.errors import (
    ProblemError,
    RevisionAhead,
    RevisionCompacted,
    WatchLost,
    problem_class,
)
from registry_client.models import Engine
from registry_client.transport import ReplicaTransport

EventType = Literal["SYNC", "ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
PAGE = 500
# Codes of a stream's final ERROR line after which another replica (or the same one, later)
# serves the watch on from its revision.
_RESUMABLE = {"shutting_down", "slow_consumer", "too_many_watchers", "store_unavailable"}
# Codes after which the watch lists again: its revision is gone from the history, or ahead of
# the store's.
_RELIST = {"revision_compacted", "revision_ahead"}
# The reconnect pauses' default: the first drawn from [0, 0.5 s), doubling to at most 8 s.
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 8.0

log = logging.getLogger("registry_client.watch")


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    revision: int
    engine: Engine | None = None  # ADDED, MODIFIED, DELETED: the group's engine
    groups: list[Engine] = field(default_factory=list)  # SYNC: every group at `revision`


class _Relist(Exception):
    pass


class _Resume(Exception):
    def __init__(self, why: str, retry_after_s: float | None = None) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s


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

    def _passed(self, revision: int) -> None:
        """The server says every change up to ``revision`` was sent (a bookmark, a final
        ERROR line)."""
        if revision >= self.done:
            self.done = revision
            if self.current <= revision:
                self.current, self.seen = 0, set()

    def accept(self, line: dict[str, Any]) -> WatchEvent | None:
        """The event to deliver for a stream line (None: a duplicate); raises on ERROR."""
        kind, revision = str(line["type"]), int(line["revision"])
        if kind == "ERROR":
            problem = line.get("object") or {}
            if problem.get("code") in _RELIST:
                log.warning("watch: %s; listing again", problem.get("detail") or problem)
                raise _Relist()
            # Every change up to the line's revision was sent: resume from there, not from the
            # last change (a restarted SQLite replica's history starts at the store's revision
            # then, and an older one would be refused: every watcher would list again).
            self._passed(revision)
            raise _Resume(str(problem.get("code")))
        if kind == "BOOKMARK":
            self._passed(revision)
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
        client: ReplicaTransport,
        *,
        revision: int | None,
        role: str | None,
        bookmarks: bool,
        idle_timeout_s: float,
        lost_after_s: float,
        model: str | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.client = client
        self.cursor = None if revision is None else Cursor(revision)
        self.filters: dict[str, str] = {
            k: v for k, v in (("role", role), ("model", model)) if v is not None
        }
        self.bookmarks = bookmarks
        self.idle_timeout_s = idle_timeout_s
        self.lost_after_s = lost_after_s
        self.backoff = backoff or Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S)
        self.url_index = 0
        self.heard = time.monotonic()
        self.failures: list[str] = []
        self.wait_s = 0.0  # the pause before the next try (set by a failure)

    def params(self, cursor: Cursor) -> dict[str, Any]:
        return {"watch": "true", "revision": cursor.resume_from} | self.filters

    def list_params(self) -> dict[str, Any]:
        return {"limit": PAGE} | self.filters

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.idle_timeout_s, connect=self.client.connect_timeout_s)

    def failed(self, why: str, retry_after_s: float | None = None) -> None:
        """A replica failed this watch: the next one serves it after a jittered pause (at
        least ``retry_after_s``); lost past the deadline."""
        self.failures.append(f"{self.client.urls[self.url_index]}: {why}")
        self.url_index = (self.url_index + 1) % len(self.client.urls)
        left = self.heard + self.lost_after_s - time.monotonic()
        if left < 0:
            raise WatchLost(
                f"watch: no registry answered for {self.lost_after_s:g} s (tried "
                f"{', '.join(self.client.urls)}; last: {'; '.join(self.failures[-3:])})",
                urls=list(self.client.urls),
                attempts=len(self.failures),
            )
        # The last try comes at the deadline, not a pause after it.
        self.wait_s = min(self.backoff.next(retry_after_s), left + 0.01)

    def pause(self) -> float:
        """The pause a failure set (0 after a success or a relist), taken once."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def check(self, response: httpx.Response, body: bytes) -> None:
        """An error answer to the watch request: relist, resume elsewhere, or raise."""
        try:
            problem = json.loads(body)
        except ValueError:
            problem = {"detail": body[:500].decode("utf-8", "replace")}
        if not isinstance(problem, dict):
            problem = {"detail": str(problem)}
        cls = problem_class(response.status_code, problem)
        if cls in (RevisionCompacted, RevisionAhead):
            log.warning("watch: %s; listing again", problem.get("detail") or problem)
            raise _Relist()
        if response.status_code >= 500:
            floor = retry_after(response.headers.get("Retry-After"))
            raise _Resume(f"{response.status_code} {problem.get('code', '')}", floor)
        raise cls(problem, status=response.status_code, url=str(response.url))

    def answered(self, url: str, cursor: Cursor) -> None:
        """A replica took the watch (200): after failures, say when and where it came back."""
        if self.failures:
            log.info(
                "watch: back on %s from revision %d after %d failed tries, %.1f s unheard "
                "(last: %s)",
                url,
                cursor.resume_from,
                len(self.failures),
                time.monotonic() - self.heard,
                self.failures[-1],
            )
        self.heard = time.monotonic()

    def handle(self, raw: str) -> WatchEvent | None:
        assert self.cursor is not None
        self.heard = time.monotonic()
        if self.failures:
            self.failures.clear()
            self.backoff.reset()
        event = self.cursor.accept(json.loads(raw))
        if event is not None and event.type == "BOOKMARK" and not self.bookmarks:
            return None
        return event

    def synced(self, body: dict[str, Any], groups: list[Engine]) -> WatchEvent:
        revision = int(body["revision"])
        self.cursor = Cursor(revision)
        self.heard = time.monotonic()
        self.failures.clear()
        self.backoff.reset()
        return WatchEvent("SYNC", revision, groups=groups)


class GroupWatch(_Watch):
    """The synchronous watch (see the module doc): ``for event in client.watch(): ...``."""

    def _list(self) -> WatchEvent:
        groups: list[Engine] = []
        params = self.list_params()
        while True:
            try:
                body = self.client.request("GET", "/tp-groups", params=params).json()
            except (RevisionCompacted, RevisionAhead):  # the walk outlived its revision
                groups, params = [], {k: v for k, v in params.items() if k != "continue"}
                continue
            groups += [Engine.from_json(g) for g in body["groups"]]
            if body.get("continue") is None:
                return self.synced(body, groups)
            params["continue"] = body["continue"]

    def __iter__(self) -> Iterator[WatchEvent]:
        http = self.client.http
        if self.cursor is None:
            yield self._list()
        while True:
            assert self.cursor is not None
            url = self.client.urls[self.url_index]
            try:
                with http.stream(
                    "GET",
                    url + "/tp-groups",
                    params=self.params(self.cursor),
                    timeout=self.timeout(),
                ) as response:
                    if response.status_code != 200:
                        self.check(response, response.read())
                    self.answered(url, self.cursor)
                    for raw in response.iter_lines():
                        if raw and (event := self.handle(raw)) is not None:
                            yield event
                self.failed("the stream ended")
            except _Relist:
                yield self._list()
            except _Resume as exc:
                self.failed(str(exc), exc.retry_after_s)
            except httpx.TransportError as exc:
                self.failed(repr(exc))
            time.sleep(self.pause())


class AsyncGroupWatch(_Watch):
    """The asynchronous watch: ``async for event in client.awatch(): ...`` (its own
    ``httpx.AsyncClient`` with the client's token and TLS)."""

    async def _list(self, http: httpx.AsyncClient) -> WatchEvent:
        groups: list[Engine] = []
        params = self.list_params()
        while True:
            url = self.client.urls[self.url_index]
            try:
                response = await http.get(url + "/tp-groups", params=params, timeout=self.timeout())
                if response.status_code != 200:
                    self.check(response, response.content)
            except _Relist:
                groups, params = [], {k: v for k, v in params.items() if k != "continue"}
                continue
            except _Resume as exc:
                self.failed(str(exc), exc.retry_after_s)
                await asyncio.sleep(self.pause())
                continue
            except httpx.TransportError as exc:
                self.failed(repr(exc))
                await asyncio.sleep(self.pause())
                continue
            body = response.json()
            groups += [Engine.from_json(g) for g in body["groups"]]
            if body.get("continue") is None:
                return self.synced(body, groups)
            params["continue"] = body["continue"]

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        async with httpx.AsyncClient(
            headers=self.client.http.headers, trust_env=False, verify=self.client.tls.context
        ) as http:
            if self.cursor is None:
                yield await self._list(http)
            while True:
                assert self.cursor is not None
                url = self.client.urls[self.url_index]
                try:
                    async with http.stream(
                        "GET",
                        url + "/tp-groups",
                        params=self.params(self.cursor),
                        timeout=self.timeout(),
                    ) as response:
                        if response.status_code != 200:
                            self.check(response, await response.aread())
                        self.answered(url, self.cursor)
                        async for raw in response.aiter_lines():
                            if raw and (event := self.handle(raw)) is not None:
                                yield event
                    self.failed("the stream ended")
                except _Relist:
                    yield await self._list(http)
                except _Resume as exc:
                    self.failed(str(exc), exc.retry_after_s)
                except httpx.TransportError as exc:
                    self.failed(repr(exc))
                await asyncio.sleep(self.pause())


__all__ = ["AsyncGroupWatch", "Cursor", "GroupWatch", "ProblemError", "WatchEvent", "WatchLost"]
