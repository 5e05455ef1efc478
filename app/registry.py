"""The domain rules: engines per launch, agents with leases, resolution and handshakes.

Keys in the store (``gid`` a group id, ``eid`` an engine id):

    groups/{gid}/engine           the current engine of the group (JSON EngineRecord)
    groups/{gid}/agents/{rank}    a live agent of the current engine, without its blob (lease)
    blobs/{gid}/{rank}            that agent's metadata blob, on the same lease
    launches/{gid}/{launch_id}    {engine_id, generation} of every launch the group has seen
    engines/{eid}                 {group_id, generation}: who was issued this engine_id

Every state change is one store transaction guarded by the engine key's mod_revision, so an
open, a registration and a deletion racing each other serialize; losers re-read and retry.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel

from app import compat as compat_rules
from app.errors import (
    EngineIdMismatch,
    EngineSuperseded,
    GroupConflict,
    Incompatible,
    InvalidRequest,
    LaunchSuperseded,
    NotFound,
    NotReady,
    StoreUnavailable,
)
from app.metrics import Metrics
from app.schemas import (
    Agent,
    AgentSummary,
    Engine,
    Handshake,
    HandshakeRequest,
    Heartbeat,
    OpenEngineRequest,
    RegisterAgentRequest,
    Role,
    Target,
    parse_host,
)
from app.store import Compare, Delete, Entry, Put, Snapshot, Store
from app.topology import TopologyError, plan_targets

# Optimistic transactions retry this often before giving up with 503 (never reached in
# practice: each retry means another writer made progress).
MAX_ATTEMPTS = 200

R = TypeVar("R", bound=BaseModel)


_SECOND: list[Any] = [None, ""]  # the last second formatted, and its text


def utc_iso(ts: float) -> str:
    """``2026-11-29T14:00:00.123Z``; the seconds part is formatted once per second."""
    whole = int(ts)
    if _SECOND[0] != whole:
        _SECOND[1] = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _SECOND[0] = whole
    return f"{_SECOND[1]}.{int((ts - whole) * 1000):03d}Z"


class EngineRecord(BaseModel):
    group_id: str
    engine_id: str
    generation: int
    launch_id: str
    tp_size: int
    role: Role
    compat: dict[str, Any]
    created_at: str


class AgentRecord(BaseModel):
    rank: int
    engine_id: str
    generation: int
    agent_name: str
    host: str
    kv: dict[str, Any]
    ttl_s: int
    registered_at: str
    lease: int


class IndexRecord(BaseModel):
    group_id: str
    generation: int
    engine_id: str = ""


def _engine_key(gid: str) -> str:
    return f"groups/{gid}/engine"


def _group_prefix(gid: str) -> str:
    return f"groups/{gid}/"


def _agent_prefix(gid: str) -> str:
    return f"groups/{gid}/agents/"


def _agent_key(gid: str, rank: int) -> str:
    return f"groups/{gid}/agents/{rank:05d}"


def _blob_key(gid: str, rank: int) -> str:
    return f"blobs/{gid}/{rank:05d}"


def _dump(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


class Decoded:
    """Stored records parsed once per version: reads re-parse nothing that did not change."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, BaseModel]] = {}

    def record(self, entry: Entry, kind: type[R]) -> R:
        hit = self._cache.get(entry.key)
        if hit is not None and hit[0] == entry.mod_revision and type(hit[1]) is kind:
            return hit[1]
        value = kind.model_validate_json(entry.value)
        if len(self._cache) >= self.LIMIT:
            self._cache.clear()
        self._cache[entry.key] = (entry.mod_revision, value)
        return value


_UNCACHED = Decoded()


@dataclass
class GroupState:
    """One consistent read of a group: its engine and live agents."""

    engine: EngineRecord
    engine_revision: int
    agents: dict[int, AgentRecord]
    agent_revisions: dict[int, int]
    expires_at: dict[int, float]
    revision: int

    @classmethod
    def read(cls, snap: Snapshot, gid: str, decoded: Decoded = _UNCACHED) -> GroupState | None:
        engine: EngineRecord | None = None
        engine_revision = 0
        agents: dict[int, AgentRecord] = {}
        revisions: dict[int, int] = {}
        expires: dict[int, float] = {}
        now = snap.read_at
        engine_key, agent_prefix = _engine_key(gid), _agent_prefix(gid)
        for entry in snap.entries:
            if entry.key == engine_key:
                engine = decoded.record(entry, EngineRecord)
                engine_revision = entry.mod_revision
            elif entry.key.startswith(agent_prefix):
                agent = decoded.record(entry, AgentRecord)
                agents[agent.rank] = agent
                revisions[agent.rank] = entry.mod_revision
                remaining = snap.lease_remaining_s.get(agent.lease, float(agent.ttl_s))
                expires[agent.rank] = now + remaining
        if engine is None:
            return None
        # Agents of an older engine never outlive its supersession, but be strict anyway.
        live = {r: a for r, a in agents.items() if a.engine_id == engine.engine_id}
        return cls(engine, engine_revision, live, revisions, expires, snap.revision)

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.engine.tp_size) if r not in self.agents]

    def view(self) -> Engine:
        e = self.engine
        return Engine.model_construct(
            group_id=e.group_id,
            engine_id=e.engine_id,
            generation=e.generation,
            launch_id=e.launch_id,
            tp_size=e.tp_size,
            role=e.role,
            compat=e.compat,
            created_at=e.created_at,
            ready=not self.missing,
            registered_ranks=sorted(r for r in self.agents if r < e.tp_size),
            missing_ranks=self.missing,
            agents=[
                AgentSummary.model_construct(
                    rank=r,
                    agent_name=a.agent_name,
                    host=a.host,
                    expires_at=utc_iso(self.expires_at[r]),
                )
                for r, a in sorted(self.agents.items())
            ],
        )


class Registry:
    def __init__(self, store: Store, metrics: Metrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.decoded = Decoded()
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
        state = GroupState.read(await self.store.range(_group_prefix(gid)), gid, self.decoded)
        if state is None:
            raise NotFound(
                f"No TP group {gid!r} in this registry. Its rank 0 opens it with "
                f"PUT /tp-groups/{gid}/engine; check the group id and the registry URL."
            )
        return state

    async def get_engine(self, gid: str, wait_ready_s: float | None = None) -> Engine:
        state = await self._group(gid)
        if not wait_ready_s:
            return state.view()
        deadline = time.monotonic() + wait_ready_s
        while state.missing and not self.draining:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await self._wait_change(_group_prefix(gid), state.revision, remaining)
            state = await self._group(gid)
        return state.view()

    async def list_groups(self) -> list[Engine]:
        snap = await self.store.range("groups/")
        by_group: dict[str, list[Any]] = {}
        for entry in snap.entries:
            gid = entry.key.split("/", 2)[1]
            by_group.setdefault(gid, []).append(entry)
        views = []
        for gid, entries in by_group.items():
            sub = Snapshot(entries, snap.revision, snap.lease_remaining_s, snap.read_at)
            state = GroupState.read(sub, gid, self.decoded)
            if state is not None:
                views.append(state.view())
        return views

    async def _index(self, engine_id: str) -> IndexRecord | None:
        entry = await self.store.get(f"engines/{engine_id}")
        return None if entry is None else IndexRecord.model_validate_json(entry.value)

    async def resolve(self, engine_id: str) -> GroupState:
        index = await self._index(engine_id)
        if index is None:
            raise NotFound(
                f"engine_id {engine_id!r} was never issued by this registry (or its group was "
                "deleted). Check that the decode and the prefill use the same registry."
            )
        state = GroupState.read(
            await self.store.range(_group_prefix(index.group_id)), index.group_id, self.decoded
        )
        if state is None:
            raise NotFound(f"engine_id {engine_id!r} belonged to a group that was deleted.")
        if state.engine.engine_id != engine_id:
            raise EngineSuperseded(
                f"engine {engine_id} was generation {index.generation} of group "
                f"{index.group_id!r}, superseded by generation {state.engine.generation} "
                f"(engine {state.engine.engine_id}): the prefill group was relaunched. "
                "Resolve the current engine and handshake again.",
                current_engine_id=state.engine.engine_id,
                current_generation=state.engine.generation,
            )
        return state

    # -- engines -----------------------------------------------------------------------------

    async def open_engine(self, gid: str, req: OpenEngineRequest) -> tuple[Engine, bool]:
        """Open the engine of ``req.launch_id``; returns (engine, created)."""
        for _ in range(MAX_ATTEMPTS):
            snap = await self.store.range(_group_prefix(gid))
            state = GroupState.read(snap, gid, self.decoded)
            generation = 1
            if state is not None:
                current = state.engine
                if current.launch_id == req.launch_id:
                    self._check_same_launch(gid, current, req)
                    return state.view(), False
                generation = current.generation + 1
            launch_key = f"launches/{gid}/{req.launch_id}"
            launch = await self.store.get(launch_key)
            if launch is not None and launch.mod_revision > snap.revision:
                continue  # a concurrent open wrote it after our read: re-read, maybe it's ours
            if launch is not None:
                seen = IndexRecord.model_validate_json(launch.value)
                current_gen = state.engine.generation if state else seen.generation
                raise LaunchSuperseded(
                    f"launch {req.launch_id!r} opened generation {seen.generation} of group "
                    f"{gid!r}, which a newer launch superseded (current generation "
                    f"{current_gen}). This process belongs to an old launch: stop it, or "
                    "restart it so that it makes a new launch_id.",
                    current_generation=current_gen,
                )
            engine = EngineRecord(
                group_id=gid,
                engine_id=str(uuid.uuid4()),
                generation=generation,
                launch_id=req.launch_id,
                tp_size=req.tp_size,
                role=req.role,
                compat=req.compat or {},
                created_at=utc_iso(time.time()),
            )
            index = IndexRecord(group_id=gid, generation=generation, engine_id=engine.engine_id)
            result = await self.store.txn(
                [
                    Compare(_engine_key(gid), state.engine_revision if state else 0),
                    Compare(launch_key, 0),
                ],
                [
                    Put(_engine_key(gid), _dump(engine)),
                    Put(launch_key, _dump(index)),
                    Put(f"engines/{engine.engine_id}", _dump(index)),
                    Delete(_agent_prefix(gid), prefix=True),
                    Delete(f"blobs/{gid}/", prefix=True),
                ],
            )
            if result.succeeded:
                self.metrics.engines_opened.inc()
                if state is not None:
                    await self._revoke_quietly(a.lease for a in state.agents.values())
                fresh = GroupState(engine, result.revision, {}, {}, {}, result.revision)
                return fresh.view(), True
        raise StoreUnavailable(f"Opening an engine for group {gid!r} lost too many races.")

    async def _revoke_quietly(self, leases: Iterable[int]) -> None:
        """End the superseded agents' leases now, so that a heartbeat racing the open cannot
        renew them. Their keys are already gone; a failure here leaves them to expire."""
        for lease in leases:
            try:
                await self.store.revoke_lease(lease)
            except StoreUnavailable:
                return

    @staticmethod
    def _check_same_launch(gid: str, current: EngineRecord, req: OpenEngineRequest) -> None:
        diffs = []
        if current.tp_size != req.tp_size:
            diffs.append(f"tp_size {req.tp_size} (open engine has {current.tp_size})")
        if current.role != req.role:
            diffs.append(f"role {req.role!r} (open engine has {current.role!r})")
        if req.compat is not None and not compat_rules.equal(current.compat, req.compat):
            diffs.append(f"compat {req.compat} (open engine has {current.compat})")
        if diffs:
            raise GroupConflict(
                f"launch {req.launch_id!r} already opened generation {current.generation} of "
                f"group {gid!r} with other settings: {'; '.join(diffs)}. Two different "
                "deployments share this group id, or a launch_id was reused: give each "
                "deployment its own group id and each process start a fresh launch_id."
            )

    async def delete_group(self, gid: str) -> None:
        for _ in range(MAX_ATTEMPTS):
            state = await self._group(gid)
            launches = await self.store.range(f"launches/{gid}/")
            engine_ids = {
                IndexRecord.model_validate_json(e.value).engine_id for e in launches.entries
            }
            engine_ids.add(state.engine.engine_id)
            ops = [
                Delete(_group_prefix(gid), prefix=True),
                Delete(f"launches/{gid}/", prefix=True),
                Delete(f"blobs/{gid}/", prefix=True),
                *(Delete(f"engines/{eid}") for eid in sorted(engine_ids) if eid),
            ]
            result = await self.store.txn([Compare(_engine_key(gid), state.engine_revision)], ops)
            if result.succeeded:
                return
        raise StoreUnavailable(f"Deleting group {gid!r} lost too many races.")

    # -- agents ------------------------------------------------------------------------------

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
        return EngineIdMismatch(
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

    async def _current(self, gid: str, rank: int, engine_id: str) -> GroupState:
        state = await self._group(gid)
        if rank >= state.engine.tp_size:
            raise InvalidRequest(
                f"rank {rank} is outside group {gid!r} of tp_size {state.engine.tp_size}.",
                errors=[
                    {
                        "loc": ["path", "rank"],
                        "msg": f"must be below tp_size {state.engine.tp_size}",
                        "type": "less_than",
                    }
                ],
            )
        if engine_id != state.engine.engine_id:
            raise await self._mismatch(state, rank, engine_id)
        return state

    async def register_agent(
        self, gid: str, rank: int, req: RegisterAgentRequest, client_host: str | None
    ) -> tuple[Agent, bool]:
        _check_reachable(req.host, client_host)
        blob = base64.b64decode(req.agent_metadata)
        for _ in range(MAX_ATTEMPTS):
            state = await self._current(gid, rank, req.engine_id)
            old = state.agents.get(rank)
            lease = await self.store.grant_lease(req.ttl_s)
            now = time.time()
            record = AgentRecord(
                rank=rank,
                engine_id=req.engine_id,
                generation=state.engine.generation,
                agent_name=req.agent_name,
                host=req.host,
                kv=req.kv.model_dump(),
                ttl_s=req.ttl_s,
                registered_at=utc_iso(now),
                lease=lease.id,
            )
            result = await self.store.txn(
                [
                    Compare(_engine_key(gid), state.engine_revision),
                    Compare(_agent_key(gid, rank), state.agent_revisions.get(rank, 0)),
                ],
                [
                    Put(_agent_key(gid, rank), _dump(record), lease=lease.id),
                    Put(_blob_key(gid, rank), blob, lease=lease.id),
                ],
            )
            if not result.succeeded:
                await self.store.revoke_lease(lease.id)
                continue
            await self.release_leases(state, {rank})
            return self._agent_view(record, now + lease.remaining_s), old is None
        raise StoreUnavailable(f"Registering rank {rank} of {gid!r} lost too many races.")

    async def release_leases(self, state: GroupState, ranks: set[int]) -> None:
        """End the leases ``ranks`` held before, unless another rank still holds one (ranks
        registered in one batch share a lease): so a heartbeat cannot renew a replaced or
        deregistered agent, and no other rank's agent goes with it."""
        old = {state.agents[r].lease for r in ranks if r in state.agents}
        kept = {a.lease for r, a in state.agents.items() if r not in ranks}
        for lease in sorted(old - kept):
            await self.store.revoke_lease(lease)

    @classmethod
    def _agent_view(cls, record: AgentRecord, expires_at: float) -> Agent:
        return cls._agent_view_at(record, utc_iso(expires_at))

    @staticmethod
    def _agent_view_at(record: AgentRecord, expires_at: str) -> Agent:
        return Agent.model_construct(
            engine_id=record.engine_id,
            generation=record.generation,
            rank=record.rank,
            agent_name=record.agent_name,
            host=record.host,
            kv=record.kv,
            ttl_s=record.ttl_s,
            registered_at=record.registered_at,
            expires_at=expires_at,
        )

    def _absent(self, gid: str, rank: int) -> NotFound:
        return NotFound(
            f"rank {rank} of group {gid!r} has no live agent (never registered, deregistered, "
            "or its lease expired): register it again with PUT "
            f"/tp-groups/{gid}/engine/agents/{rank}."
        )

    async def heartbeat(self, gid: str, rank: int, engine_id: str) -> Heartbeat:
        state = await self._current(gid, rank, engine_id)
        agent = state.agents.get(rank)
        if agent is None:
            raise self._absent(gid, rank)
        lease = await self.store.refresh_lease(agent.lease)
        if lease is None:
            raise self._absent(gid, rank)
        return Heartbeat.model_construct(expires_at=utc_iso(time.time() + lease.remaining_s))

    async def deregister(self, gid: str, rank: int, engine_id: str) -> None:
        state = await self._current(gid, rank, engine_id)
        agent = state.agents.get(rank)
        if agent is None:
            raise self._absent(gid, rank)
        await self.store.txn(
            [Compare(_agent_key(gid, rank), state.agent_revisions[rank])],
            [Delete(_agent_key(gid, rank)), Delete(_blob_key(gid, rank))],
        )
        await self.release_leases(state, {rank})

    # -- handshake ---------------------------------------------------------------------------

    async def handshake(self, engine_id: str, req: HandshakeRequest) -> Handshake:
        state = await self.resolve(engine_id)
        engine = state.engine
        try:
            plan = plan_targets(engine.tp_size, req.tp_size, req.rank)
        except TopologyError as exc:
            raise InvalidRequest(
                f"decode TP {req.tp_size} cannot pair with prefill TP {engine.tp_size} of "
                f"engine {engine_id}: {exc}. The larger TP size must be a multiple of the "
                "smaller.",
                errors=[{"loc": ["body", "tp_size"], "msg": str(exc), "type": "tp_ratio"}],
            ) from None
        found: list[dict[str, Any]] = []
        if engine.role == "decode":
            found.append({"field": "role", "remote": "decode", "local": "decode"})
        if req.compat:
            found.extend(compat_rules.mismatches(engine.compat, req.compat))
        if found:
            fields = ", ".join(
                f"{m['field']} (prefill {m['remote']!r}, decode {m['local']!r})" for m in found
            )
            raise Incompatible(
                f"engine {engine_id} (group {engine.group_id!r}) cannot serve this decode "
                f"rank: {fields}. Pair engines built from the same model and KV settings, "
                "and a prefill-capable role.",
                mismatches=found,
            )
        missing = [r for r in plan.target_ranks if r not in state.agents]
        by_rank: dict[int, bytes] = {}
        if not missing:
            by_rank = await self._blobs(engine.group_id, plan.target_ranks)
            missing = [r for r in plan.target_ranks if r not in by_rank]
        if missing:
            raise NotReady(
                f"target ranks {sorted(missing)} of engine {engine_id} (group "
                f"{engine.group_id!r}, generation {engine.generation}) have no live agent: "
                "they are starting, or died and their lease expired. Retry shortly, or "
                "wait with GET /tp-groups/{group}/engine?wait_ready=S.",
                missing_ranks=sorted(missing),
            )
        targets = []
        for r in plan.target_ranks:
            agent = state.agents[r]
            targets.append(
                Target.model_construct(
                    rank=r,
                    agent_name=agent.agent_name,
                    agent_metadata=base64.b64encode(by_rank[r]).decode(),
                    host=agent.host,
                    kv=agent.kv,
                    expires_at=utc_iso(state.expires_at[r]),
                )
            )
        return Handshake.model_construct(
            engine_id=engine.engine_id,
            group_id=engine.group_id,
            generation=engine.generation,
            remote_tp_size=engine.tp_size,
            tp_ratio=plan.tp_ratio,
            targets=targets,
        )

    async def _blobs(self, gid: str, ranks: list[int]) -> dict[int, bytes]:
        """The metadata blobs of ``ranks``: a get each for a few, one range read for many
        (linear in the number of targets either way)."""
        if len(ranks) == 1:
            blob = await self.store.get(_blob_key(gid, ranks[0]))
            return {} if blob is None else {ranks[0]: blob.value}
        if len(ranks) <= 8:
            found = await asyncio.gather(*(self.store.get(_blob_key(gid, r)) for r in ranks))
            return {r: b.value for r, b in zip(ranks, found, strict=True) if b is not None}
        wanted = set(ranks)
        by_rank = {}
        for entry in (await self.store.range(f"blobs/{gid}/")).entries:
            rank = int(entry.key.rsplit("/", 1)[1])
            if rank in wanted:
                by_rank[rank] = entry.value
        return by_rank

    # -- observability -----------------------------------------------------------------------

    async def refresh_gauges(self) -> None:
        groups = await self.list_groups()
        self.metrics.groups.set(len(groups))
        self.metrics.ready_groups.set(sum(g.ready for g in groups))
        self.metrics.live_agents.set(sum(len(g.registered_ranks) for g in groups))


def _check_reachable(host: str, client_host: str | None) -> None:
    """Refuse a loopback ``host`` from a rank that reached us over the network."""
    address = parse_host(host)
    if address is None or not address.is_loopback or client_host is None:
        return
    try:
        client = parse_host(client_host)
    except ValueError:
        return
    if client is not None and not client.is_loopback:
        raise InvalidRequest(
            f"host {host!r} is a loopback address, but this rank reached the registry from "
            f"{client_host}: peers on other nodes cannot reach it there. Advertise the "
            "address of the interface that routes to the registry.",
            errors=[
                {
                    "loc": ["body", "host"],
                    "msg": "loopback host from a remote client",
                    "type": "unreachable_host",
                }
            ],
        )
