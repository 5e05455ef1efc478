"""One consistent read of a group, and its view as the API answers it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from app.core.schemas import (
    AgentSummary,
    Engine,
    Serving,
)
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.records import (
    _UNCACHED,
    AgentBrief,
    AgentRecord,
    Decoded,
    EngineRecord,
    ServingRecord,
)
from app.store import Snapshot


@dataclass
class GroupState:
    """One consistent read of a group: its engine and live agents (whole records, or their
    briefs when read with ``brief``: no ``kv``, for listings, gauges and the status page)."""

    engine: EngineRecord
    engine_revision: int
    agents: dict[int, AgentBrief]
    agent_revisions: dict[int, int]
    expires_at: dict[int, float]
    revision: int
    serving: ServingRecord | None = None
    serving_revision: int = 0

    @classmethod
    def read(
        cls, snap: Snapshot, gid: str, decoded: Decoded = _UNCACHED, *, brief: bool = False
    ) -> GroupState | None:
        engine: EngineRecord | None = None
        engine_revision = 0
        agents: dict[int, AgentBrief] = {}
        revisions: dict[int, int] = {}
        expires: dict[int, float] = {}
        serving: ServingRecord | None = None
        serving_revision = 0
        now = snap.read_at
        engine_key, agent_prefix = keys.engine(gid), keys.agent_prefix(gid)
        serving_key = keys.serving(gid)
        for entry in snap.entries:
            if entry.key == engine_key:
                engine = decoded.record(entry, EngineRecord)
                engine_revision = entry.mod_revision
            elif entry.key == serving_key:
                serving = decoded.record(entry, ServingRecord)
                serving_revision = entry.mod_revision
            elif entry.key.startswith(agent_prefix):
                agent = decoded.brief(entry) if brief else decoded.record(entry, AgentRecord)
                agents[agent.rank] = agent
                revisions[agent.rank] = entry.mod_revision
                remaining = snap.lease_remaining_s.get(agent.lease, float(agent.ttl_s))
                expires[agent.rank] = now + remaining
        if engine is None:
            return None
        # Agents of an older engine never outlive its supersession, but be strict anyway.
        live = {r: a for r, a in agents.items() if a.engine_id == engine.engine_id}
        if serving is not None and serving.engine_id != engine.engine_id:
            serving, serving_revision = None, 0  # published by an older launch
        return cls(
            engine,
            engine_revision,
            live,
            revisions,
            expires,
            snap.revision,
            serving,
            serving_revision,
        )

    @functools.cached_property
    def missing(self) -> list[int]:
        """Computed once: a state is read, never changed (the status page asks a fleet's
        12,500 groups several times each)."""
        return [r for r in range(self.engine.tp_size) if r not in self.agents]

    def view(self, *, bare: bool = False) -> Engine:
        """The engine as the API shows it; ``bare``: without its agents and serving record
        (``app/watch/rendered.py`` writes those in)."""
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
            opened_by=e.opened_by,
            ready=not self.missing,
            registered_ranks=sorted(r for r in self.agents if r < e.tp_size),
            missing_ranks=self.missing,
            agents=[]
            if bare
            else [
                AgentSummary.model_construct(
                    rank=r,
                    agent_name=a.agent_name,
                    host=a.host,
                    expires_at=utc_iso(self.expires_at[r]),
                )
                for r, a in sorted(self.agents.items())
            ],
            serving=None if bare else self.serving_view(),
        )

    def serving_view(self) -> Serving | None:
        s = self.serving
        if s is None:
            return None
        return Serving.model_construct(
            url=s.url,
            model=s.model,
            dp_rank=s.dp_rank,
            bootstrap=s.bootstrap,
            published_at=s.published_at,
            published_by=s.published_by,
        )
