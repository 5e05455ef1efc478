"""One replica's feed of group changes: one store change stream (``Store.changes`` on
``groups/``: SQLite's history, etcd's watch) for every watcher and list page of the process.

The feed keeps every group's stored entries as of its ``progress`` (the store revision up to
which it has applied every change), turns each store revision's changes into one event per
group touched (ADDED, MODIFIED, DELETED with the group's engine as the API shows it),
appends them to a bounded :class:`ChangeLog`, and wakes the watchers. The same revision gives
the same events on every replica of an etcd store, which is what lets a watcher resume on
another replica at its last revision.

A broken stream is opened again after ``progress`` (through another etcd member); a history
compacted under it makes the feed read the groups again and start a new log: watchers older
than that are told ``revision_compacted`` and relist.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time

from sortedcontainers import SortedList

from app.core.schemas import Engine
from app.registry import keys
from app.registry.records import Decoded, EngineRecord
from app.registry.state import GroupState
from app.store import ChangeBatch, Compacted, Entry, Snapshot, Store, Unavailable
from app.store.tasks import stop
from app.watch.history import ENTRY_BYTES, EVENT_BASE_BYTES, ChangeLog, Group, GroupEvent
from app.watch.rendered import Rendered
from registry_client.backoff import Backoff

log = logging.getLogger("app.watch")

PREFIX = "groups/"
# ``reached``'s heap is swept of ended waits (timed out, cancelled) once it holds this many and
# twice the waits in progress (so a sweep's cost is paid for by the pushes before it).
DUE_PRUNE_AT = 4096


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def group_of(key: str) -> str:
    return key[len(PREFIX) :].partition("/")[0]


def view(
    gid: str,
    group: Group,
    revision: int,
    decoded: Decoded,
    remaining: dict[int, float] | None = None,
    now: float | None = None,
) -> Engine | None:
    """The group's engine as the API shows it; ``remaining``: its leases' time left (else a
    full TTL from ``now``)."""
    entries = [group[k] for k in sorted(group)]
    snap = Snapshot(entries, revision, remaining or {}, time.time() if now is None else now)
    state = GroupState.read(snap, gid, decoded, brief=True)  # a view needs no kv
    return None if state is None else state.view()


def selected(decoded: Decoded, entry: Entry) -> tuple[str, str | None]:
    """What a filter (`Selector`) reads of an engine's entry: its role and ``compat["model"]``."""
    record = decoded.record(entry, EngineRecord)
    model = record.compat.get("model")
    return record.role, model if isinstance(model, str) else None


def encode(kind: str, revision: int, engine: Engine | None) -> bytes:
    body = b"null" if engine is None else engine.__pydantic_serializer__.to_json(engine)
    return b'{"type":"%s","revision":%d,"object":%s}\n' % (kind.encode(), revision, body)


def _line(kind: str, revision: int, gid: str, group: Group, decoded: Decoded, now: float) -> bytes:
    """An event's wire line: the group's engine as the API showed it at ``revision``."""
    return encode(kind, revision, view(gid, group, revision, decoded, now=now))


class Feed:
    def __init__(
        self,
        store: Store,
        decoded: Decoded,
        *,
        keep: int = 10_000,
        keep_bytes: int | None = None,
        progress_s: float = 1.0,
    ) -> None:
        self.store = store
        self.decoded = decoded
        self.progress_s = progress_s
        self.groups: dict[str, Group] = {}
        # the ids of ``groups`` in order, kept as groups come and go: a list page starts at
        # its token's group without sorting 12,500 ids (3-6 ms a page at 100,000 ranks)
        self.order: SortedList[str] = SortedList()
        self.log = ChangeLog(keep, keep_bytes)
        self.progress = 0
        self.epoch = 0  # a new log (after a compaction): older positions mean nothing
        self.loaded: asyncio.Future[None] | None = None
        self.failure: str | None = None
        self._news: asyncio.Future[None] | None = None
        # ``reached``'s waiters by revision: each woken once, when the feed passes it
        self._due: list[tuple[int, int, asyncio.Future[None]]] = []
        self._due_order = itertools.count()
        self._waiting = 0  # waits in ``reached`` now
        self._nudge = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closing = False
        self.rendered = Rendered()  # list pages' views of the groups, as JSON

    # -- following the store -----------------------------------------------------------------

    def start(self) -> None:
        self.loaded = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        self.closing = True
        self._wake()
        if self._task is not None:
            await stop(self._task)  # its store's stream never ends: a lost cancel is retried

    async def _load(self) -> None:
        snap = await self.store.entries(PREFIX)
        groups: dict[str, dict[str, Entry]] = {}
        for entry in snap.entries:
            groups.setdefault(group_of(entry.key), {})[entry.key] = entry
        self.groups = dict(groups)
        self.order = SortedList(self.groups)
        self.progress = snap.revision
        self.log.reset(snap.revision)
        self.epoch += 1
        if self.loaded is not None and not self.loaded.done():
            self.loaded.set_result(None)
        self._wake()

    async def _run(self) -> None:
        """Follow the store; after a failure, the one back-off policy (``registry_client.backoff``:
        full jitter, so the replicas of an etcd store that lost a member do not all come
        back to the next one in the same instant), reset by the next change applied."""
        fresh = True
        pauses = Backoff(base_s=0.2, cap_s=5.0)
        while not self.closing:
            try:
                if fresh:
                    await self._load()
                    fresh = False
                stream = self.store.changes(PREFIX, self.progress + 1, self.progress_s, self._nudge)
                async for batch in stream:
                    self._apply(batch)
                    if self.failure is not None or pauses.tries:
                        self.failure = None
                        pauses.reset()
            except Compacted as exc:
                log.warning(
                    "watch history compacted: reading the groups again",
                    extra={"oldest": exc.oldest},
                )
                fresh = True
            except Unavailable as exc:
                self.failure = exc.detail
                await asyncio.sleep(pauses.next())
            except Exception:
                log.exception("the watch feed failed; following again")
                self.failure = "the watch feed failed"
                await asyncio.sleep(pauses.next())

    def _apply(self, batch: ChangeBatch) -> None:
        if batch.changes:
            touched: dict[str, Group | None] = {}
            for change in batch.changes:
                gid = group_of(change.key)
                group = self.groups.get(gid)
                if gid not in touched:
                    touched[gid] = group
                new = dict(group) if group is not None else {}
                if change.entry is None:
                    new.pop(change.key, None)
                else:
                    new[change.key] = change.entry
                if new:
                    if group is None:
                        self.order.add(gid)
                    self.groups[gid] = new
                elif group is not None:
                    del self.groups[gid]
                    self.order.remove(gid)
            now = time.time()
            for gid, before in touched.items():
                self._event(gid, before, batch.revision, now)
        self.progress = max(self.progress, batch.revision)
        self._wake()

    def _event(self, gid: str, before: Group | None, revision: int, now: float) -> None:
        """The group's event; its line (the engine's view) is made when a watcher reads it.
        ``GroupState.read`` has an engine exactly when the engine's key is there."""
        after = self.groups.get(gid)
        key = keys.engine(gid)
        if after is not None and key in after:
            kind, shown = ("MODIFIED" if before is not None and key in before else "ADDED"), after
        elif before is not None and key in before:
            kind, shown = "DELETED", before
        else:
            return  # keys of no engine, before and after
        role, model = selected(self.decoded, shown[key])
        prior = selected(self.decoded, before[key]) if kind == "MODIFIED" and before else None
        weight = EVENT_BASE_BYTES + ENTRY_BYTES * (len(shown) + len(before or ()))
        args = (kind, revision, gid, shown, self.decoded, now)
        self.log.append(
            GroupEvent(
                revision,
                gid,
                kind,
                role,
                _line,
                before,
                *args,
                model=model,
                prior=prior,
                weight=weight,
            )
        )

    # -- waiting -----------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._news is not None and not self._news.done():
            self._news.set_result(None)
        self._news = None
        due = self._due
        while due and (due[0][0] <= self.progress or self.closing):
            _settle(heapq.heappop(due)[2])

    def news(self) -> asyncio.Future[None]:
        """A future that completes at the feed's next progress (or its closing)."""
        if self._news is None:
            self._news = asyncio.get_running_loop().create_future()
        return self._news

    @property
    def following(self) -> bool:
        """Loaded, following the store, not failed: its groups are the store's, lagging."""
        loaded = self.loaded is not None and self.loaded.done()
        return loaded and self.failure is None and not self.closing

    async def ready(self, timeout_s: float) -> None:
        """Wait for the feed's first read of the groups (a replica just started)."""
        if self.loaded is None:
            raise Unavailable("The watch feed is not started.")
        try:
            await asyncio.wait_for(asyncio.shield(self.loaded), timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"The registry could not read the groups within {timeout_s:g} s: "
                f"{self.failure or 'the store did not answer'}."
            ) from None

    async def reached(self, revision: int, timeout_s: float, *, nudge: bool = True) -> bool:
        """Whether the feed has applied every change up to ``revision``, waiting at most
        ``timeout_s`` for it (asking etcd for its progress once; ``nudge`` False: not, for a
        revision that is a write the feed watches, which its stream delivers unasked); a
        failing feed answers False at once.

        Each waiter is woken once, when the feed passes its revision (a heap by revision),
        not at every change: a node's heartbeat on etcd waits here, and at 100,000 ranks on
        etcd thousands waited at once while the launch's changes came in; woken at every
        change, each made another wait, and that took the event loop's time the feed needed to
        catch up (``docs/benchmarks.md``)."""
        if self.progress >= revision:
            return True
        if not self.following:
            return False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if len(self._due) >= max(DUE_PRUNE_AT, 2 * self._waiting):
            # waits that ended (timed out, cancelled) leave the heap here at the latest
            self._due = [d for d in self._due if not d[2].done()]
            heapq.heapify(self._due)
        heapq.heappush(self._due, (revision, next(self._due_order), waiter))
        self._waiting += 1
        if nudge:
            self._nudge.set()
        timer = loop.call_later(timeout_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiting -= 1
        return self.progress >= revision and not self.closing

    async def caught_up(self, timeout_s: float) -> int:
        """Wait until the feed has applied every change up to the store's revision now (a
        list sees every write answered before it); returns the feed's revision."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self.ready(timeout_s)
        head = await self.store.revision()
        while self.progress < head:
            left = deadline - loop.time()
            if left <= 0:
                raise Unavailable(
                    f"The registry's view of the store is behind it (at revision "
                    f"{self.progress}, the store at {head}): {self.failure or 'catching up'}."
                )
            self._nudge.set()
            await asyncio.wait({self.news()}, timeout=min(left, self.progress_s))
        return self.progress
