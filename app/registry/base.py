"""The registry's shared reads and checks: groups, engine resolution, mismatches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Protocol

from app.core.errors import (
    EngineIdMismatch,
    EngineSuperseded,
    FieldPath,
    FieldProblem,
    InvalidRequest,
    NotFound,
)
from app.core.metrics import Metrics
from app.core.schemas import (
    Engine,
)
from app.registry import keys
from app.registry.blobs import Codec
from app.registry.events import EventLog
from app.registry.fresh import FRESH_WAIT_S, EngineGroups, Heads
from app.registry.kept_states import KeptStates
from app.registry.observer import Observer
from app.registry.records import AgentRecord, Decoded, EngineRecord, IndexRecord
from app.registry.state import GroupState
from app.store import Entry, Snapshot, Store

# How long an operator's read of every group (the status page, /metrics) waits for the watch
# feed to reach the store's revision before it answers 503, as a list page does.
STATES_WAIT_S = 10.0
STATES_SLICE = 1000  # groups read between two turns of the event loop


class SeenGroups(Protocol):
    """What the replica's watch feed shows: every group's entries as of ``progress``."""

    @property
    def progress(self) -> int: ...

    @property
    def groups(self) -> Mapping[str, Mapping[str, Entry]]: ...

    @property
    def order(self) -> Iterable[str]:
        """The ids of ``groups``, in order."""
        ...

    @property
    def following(self) -> bool:
        """Loaded, and following the store (not failed)."""
        ...

    async def reached(self, revision: int, timeout_s: float, *, nudge: bool = True) -> bool:
        """True once ``progress >= revision`` (False: not within ``timeout_s``); ``nudge``
        False: a revision of a write the feed watches, reached without asking the store."""
        ...

    async def caught_up(self, timeout_s: float) -> int:
        """Wait until ``progress`` reaches the store's revision now; returns it."""
        ...


def _no_group(gid: str) -> NotFound:
    return NotFound(
        f"No TP group {gid!r} in this registry. Its rank 0 opens it with "
        f"PUT /tp-groups/{gid}/engine; check the group id and the registry URL."
    )


class RegistryBase:
    seen: SeenGroups | None = None  # the app sets its watch feed here

    def __init__(
        self,
        store: Store,
        metrics: Metrics | None = None,
        events_keep: int = 1000,
        blob_codec: Codec = "deflate",
    ) -> None:
        self.store = store
        self.blob_codec: Codec = blob_codec  # how blobs are stored (app/registry/blobs.py)
        self.metrics = metrics or Metrics()
        self.events = EventLog(store, self.metrics, keep=events_keep)
        self.observer = Observer(self.metrics, self.events)
        self.decoded = Decoded()
        # Each lease that runs out is recorded as the store ends it (``lease_expired``).
        store.on_expired = partial(self.observer.lease_ended, decoded=self.decoded)
        self.kept = KeptStates()  # every group's state for operators' reads (group_states)
        self.heads = Heads(store)  # the store's revision, for reads from the feed (fresh.py)
        self.engine_groups = EngineGroups()
        self.draining = False
        self._drained: asyncio.Event | None = None

    def drain(self) -> None:
        """The service is shutting down: every held ``wait_ready`` answers now."""
        self.draining = True
        if self._drained is not None:
            self._drained.set()

    async def _wait_change(self, prefix: str, revision: int, timeout_s: float) -> None:
        if self._drained is None:
            self._drained = asyncio.Event()
            if self.draining:
                self._drained.set()
        change = asyncio.ensure_future(self.store.wait(prefix, revision, timeout_s))
        drained = asyncio.ensure_future(self._drained.wait())
        try:
            await asyncio.wait({change, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            drained.cancel()
        if change.done() and not change.cancelled():
            change.result()  # a store failure answers 503

    # -- reads -------------------------------------------------------------------------------

    async def _group(self, gid: str) -> GroupState:
        state = await self._group_or_none(gid)
        if state is None:
            raise _no_group(gid)
        return state

    async def _group_or_none(self, gid: str, *, settled: bool = True) -> GroupState | None:
        snap = await self.store.range(keys.group_prefix(gid), settled=settled)
        return GroupState.read(snap, gid, self.decoded)

    async def get_engine(self, gid: str, wait_ready_s: float | None = None) -> Engine:
        state = await self._group_read(gid)
        if not wait_ready_s:
            return state.view()
        deadline = time.monotonic() + wait_ready_s
        while state.missing and not self.draining:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await self._wait_change(keys.group_prefix(gid), state.revision, remaining)
            state = await self._group_read(gid)
        return state.view()

    async def _group_read(self, gid: str) -> GroupState:
        """A reader's ``_group``: from the watch feed when it is current (``fresh.py``)."""
        if not await self._seen_now():
            self.metrics.store_reads.inc()
            return await self._group(gid)
        self.metrics.feed_reads.inc()
        state = await self._seen_state(gid)
        if state is None:
            raise _no_group(gid)
        return state

    async def _seen_now(self) -> bool:
        """Whether the watch feed shows every write answered before this call, on a store
        whose reads are round trips (``Store.remote_reads``; ``fresh.py``). False: read the
        store (no feed, a failed one, one lagging past ``FRESH_WAIT_S``, SQLite)."""
        seen = self.seen
        if seen is None or not self.store.remote_reads or not seen.following:
            return False
        return await seen.reached(await self.heads.after_now(), FRESH_WAIT_S)

    async def _seen_for_write(self, gid: str) -> GroupState | None:
        """A write's first look at a group on a store whose reads are round trips: the watch
        feed's state while the feed follows the store (no Range: at a fleet's launch on etcd,
        one a registration). Its compares (each key at the revision the feed shows) hold only
        if the store shows the same, so a feed behind makes the write lose and the next try
        reads the store; a refusal is decided on the store's state, never on this. None: no
        such feed, or it shows no engine for the group even once it reached the store's
        revision now (``_seen_now``: one read shared by the writes waiting for it; a
        registration right after its open comes before the open's watch event half the time
        at a fleet's launch)."""
        seen = self.seen
        if seen is None or not self.store.remote_reads or not seen.following:
            return None
        state = await self._seen_state(gid)
        if state is None and await self._seen_now():
            state = await self._seen_state(gid)
        return state

    async def _seen_state(self, gid: str) -> GroupState | None:
        """The group as the watch feed shows it now, its entries on leases whose time is out
        left out as a range read leaves them out; None when the feed has no engine for it."""
        assert self.seen is not None
        revision, group = self.seen.progress, self.seen.groups.get(gid)
        if group is None:
            return None
        entries = [group[k] for k in sorted(group)]
        leases = {e.lease for e in entries if e.lease is not None}
        remaining = await self.store.lease_remaining(leases) if leases else {}
        entries = [e for e in entries if e.lease is None or remaining.get(e.lease, 1.0) > 0]
        return GroupState.read(Snapshot(entries, revision, remaining), gid, self.decoded)

    async def list_groups(self) -> list[Engine]:
        return [state.view() for state in await self.group_states()]

    async def group_states(self) -> list[GroupState]:
        """Every group, the agents as briefs (no ``kv``: at a fleet's size the whole records
        outgrow their cache and each read parsed them), as of one revision; each group's
        state made once per version of it (``app/registry/kept_states.py``)."""
        groups, revision, remaining = await self._every_group()
        read_at = time.time()
        states = []
        for i, (gid, entries) in enumerate(groups):
            if i % STATES_SLICE == STATES_SLICE - 1:
                await asyncio.sleep(0)  # let heartbeats in: 12,500 groups took 1.2 s
            state = self.kept.state(gid, entries, revision, remaining, read_at, self.decoded)
            if state is not None:
                states.append(state)
        self.kept.keep_only({gid for gid, _ in groups})
        return states

    async def _every_group(self) -> tuple[list[tuple[str, list[Entry]]], int, dict[int, float]]:
        """Each group's entries in group order, their revision, their leases' time left.

        From the replica's watch feed when it follows the store, once it has applied every
        change up to the store's revision now (so, as a list page, it shows every write
        answered before it): a range read of every group is every agent's blob, 800 MB from
        etcd at 100,000 ranks, about 6 s a status page or a scrape of /metrics. Else (no feed,
        or a failed one) that range read."""
        seen = self.seen
        if seen is None or not seen.following:
            snap = await self.store.range("groups/")
            by_group: dict[str, list[Entry]] = {}
            for entry in snap.entries:
                by_group.setdefault(entry.key.split("/", 2)[1], []).append(entry)
            return list(by_group.items()), snap.revision, snap.lease_remaining_s
        revision = await seen.caught_up(STATES_WAIT_S)
        shown = seen.groups  # a group's mapping is replaced on a change, never changed
        groups = [(gid, list(shown[gid].values())) for gid in seen.order]  # in order
        leases = {e.lease for _, entries in groups for e in entries if e.lease is not None}
        remaining = await self.store.lease_remaining(leases) if leases else {}
        ended = {lease for lease, left in remaining.items() if left <= 0}
        if ended:  # expired, its keys not yet deleted: what a range read would not show
            groups = [
                (gid, [e for e in entries if e.lease not in ended]) for gid, entries in groups
            ]
        return groups, revision, remaining

    async def _index(self, engine_id: str) -> IndexRecord | None:
        entry = await self.store.get(f"engines/{engine_id}")
        if entry is None:
            return None
        index = self.decoded.record(entry, IndexRecord)
        self.engine_groups.learn(engine_id, index.group_id)
        return index

    async def resolve(self, engine_id: str, *, seen: bool | None = None) -> GroupState:
        """The group whose current engine is ``engine_id``, else 404 or 410. ``seen``: whether
        the watch feed is current (``_seen_now``), when the caller asked already."""
        if seen is None:
            seen = await self._seen_now()
        if seen:
            state = await self._resolved_as_seen(engine_id)
            if state is not None:
                self.metrics.feed_reads.inc()
                return state
        self.metrics.store_reads.inc()
        index = await self._index(engine_id)
        if index is None:
            raise NotFound(
                f"engine_id {engine_id!r} was never issued by this registry (or its group was "
                "deleted). Check that the decode and the prefill use the same registry."
            )
        state = GroupState.read(
            await self.store.range(keys.group_prefix(index.group_id)), index.group_id, self.decoded
        )
        if state is None:
            raise NotFound(f"engine_id {engine_id!r} belonged to a group that was deleted.")
        if state.engine.engine_id != engine_id:
            error = EngineSuperseded(
                f"engine {engine_id} was generation {index.generation} of group "
                f"{index.group_id!r}, superseded by generation {state.engine.generation} "
                f"(engine {state.engine.engine_id}): the prefill group was relaunched. "
                "Resolve the current engine and handshake again.",
                current_engine_id=state.engine.engine_id,
                current_generation=state.engine.generation,
            )
            self.events.refusal(error, index.group_id, engine_id=engine_id)
            raise error
        return state

    async def _resolved_as_seen(self, engine_id: str) -> GroupState | None:
        """From the current feed: the group whose current engine is ``engine_id``; None
        when the feed does not show that (superseded, deleted, unknown: the store says which)."""
        assert self.seen is not None
        gid = self.engine_groups.group(engine_id, self.seen.groups, self.decoded)
        state = None if gid is None else await self._seen_state(gid)
        return state if state is not None and state.engine.engine_id == engine_id else None

    # -- shared by agents and batches ---------------------------------------------------

    async def _mismatch(self, state: GroupState, rank: int, got: str) -> EngineIdMismatch:
        gid, current = state.engine.group_id, state.engine
        index = await self._index(got)
        if index is not None and index.group_id == gid:
            cause = "superseded"
            why = (
                f"it is generation {index.generation} of this group, superseded by generation "
                f"{current.generation}: the rank belongs to an old launch. Restart it with the "
                "current launch, or stop it."
            )
        elif index is not None:
            cause = "other_group"
            why = (
                f"it was issued to group {index.group_id!r} (generation {index.generation}): "
                "the group id differs across this group's nodes. Give every node of one TP "
                "group the same group id."
            )
        else:
            cause = "unknown"
            why = (
                "this registry never issued it: the rank made up its own engine_id (as vLLM "
                "does per node without a registry) or talks to another registry. Point every "
                "rank at the same registry and take the engine_id it issues."
            )
        self.metrics.mismatches.labels(cause).inc()
        error = EngineIdMismatch(
            f"rank {rank} of group {gid!r} sent engine_id {got}, but the current engine is "
            f"{current.engine_id} (generation {current.generation}); {why}",
            expected_engine_id=current.engine_id,
            got_engine_id=got,
            cause=cause,
            group_id=gid,
            rank=rank,
            current_generation=current.generation,
            got_generation=index.generation if index else None,
        )
        self.events.refusal(error, gid)
        return error

    async def _current(
        self, gid: str, rank: int, engine_id: str, *, writing: bool = False
    ) -> GroupState:
        """The group, checked for ``rank`` and ``engine_id``.

        ``writing``: the caller changes the group and answers only after its own commit, so it
        may decide on changes still on their way to the file (its commit lands after theirs
        and fails with them) instead of waiting for them. A refusal is an answer about the
        group, so it is only ever decided on durable state: read again, settled."""
        if writing:
            state = await self._for_rank(gid, rank, engine_id)
            if state is not None:
                return state
        state = await self._group(gid)
        if rank >= state.engine.tp_size:
            raise outside_group(gid, rank, state.engine.tp_size, ("rank",))
        if engine_id != state.engine.engine_id:
            raise await self._mismatch(state, rank, engine_id)
        return state

    async def _for_rank(self, gid: str, rank: int, engine_id: str) -> GroupState | None:
        """For a writer: the group read unsettled, as ``_current(writing=True)`` reads; None
        when the engine does not fit (the caller then decides on durable state). For a rank
        with no live agent, the engine and that rank's key only (two lookups instead of
        decoding the whole group); a live agent's lease must be weighed against the other
        ranks' (``release_leases``), so then the whole group."""
        entry = await self.store.get(keys.engine(gid), settled=False)
        if entry is None:
            return None
        engine = self.decoded.record(entry, EngineRecord)
        if rank >= engine.tp_size or engine_id != engine.engine_id:
            return None
        agent = await self.store.get(keys.agent(gid, rank), settled=False)
        if agent is None or self.decoded.record(agent, AgentRecord).engine_id != engine_id:
            revisions = {} if agent is None else {rank: agent.mod_revision}
            revision = max([entry.mod_revision, *revisions.values()])
            return GroupState(engine, entry.mod_revision, {}, revisions, {}, revision)
        state = await self._group_or_none(gid, settled=False)  # etcd: it may have moved on
        return state if state is not None and self._fits(state, rank, engine_id) else None

    @staticmethod
    def _fits(state: GroupState, rank: int, engine_id: str) -> bool:
        return rank < state.engine.tp_size and engine_id == state.engine.engine_id

    async def release_leases(self, state: GroupState, ranks: set[int]) -> None:
        """End the leases ``ranks`` held before, unless another rank still holds one (ranks
        registered in one batch share a lease): so a heartbeat cannot renew a replaced or
        deregistered agent, and no other rank's agent goes with it."""
        old = {state.agents[r].lease for r in ranks if r in state.agents}
        kept = {a.lease for r, a in state.agents.items() if r not in ranks}
        for lease in sorted(old - kept):
            await self.store.revoke_lease(lease)

    def _absent(self, gid: str, rank: int) -> NotFound:
        return NotFound(
            f"rank {rank} of group {gid!r} has no live agent (never registered, deregistered, "
            "or its lease expired): register it again with PUT "
            f"/tp-groups/{gid}/engine/agents/{rank}."
        )

    # -- observability -----------------------------------------------------------------------

    async def refresh_gauges(self) -> list[GroupState]:
        states = await self.group_states()
        self.observer.observe(states)
        self.metrics.groups.set(len(states))
        self.metrics.ready_groups.set(sum(not s.missing for s in states))
        # the ranks below tp_size with a live agent
        self.metrics.live_agents.set(sum(s.engine.tp_size - len(s.missing) for s in states))
        return states


def outside_group(
    gid: str, rank: int, tp_size: int, field: FieldPath, where: str = "", after: str = ""
) -> InvalidRequest:
    """The 422 for a rank at or past the group's tp_size (``field``: where the rank was given)."""
    return InvalidRequest(
        f"rank {rank}{where} is outside group {gid!r} of tp_size {tp_size}{after}.",
        fields=[FieldProblem(field, f"must be below tp_size {tp_size}", "less_than")],
    )
