"""What a replica learns of lease expiries, and by comparing its reads of every group.

A ``lease_expired`` event is recorded when the store ends a lease because its time ran out
(``Store.on_expired``: the SQLite sweep, the etcd replica's reaper), at that moment, once per
lease: ``lease_ended``. A lease etcd ends itself (no live replica followed it) has none.

The rest is fed by the store-wide reads the registry already does (each ``/metrics`` scrape,
each render of ``/status``), never by the request paths. From two reads it tells:

- lease expiries: a rank of the same engine whose agent is gone (or was replaced by a new
  registration) after its lease's expiry instant: counted (``registry_lease_expiries``);
- the last host of each rank, so that a missing rank can be shown with the host it was on;
- how long each group has been not ready (``registry_longest_not_ready_seconds``).

Each replica observes on its own: what it did not see (an agent that came and went between
two of its reads) it cannot tell. With several replicas, each counts the same expiries:
aggregate with ``max``, not ``sum`` (deploy/monitoring/ does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

from app.core.metrics import Metrics
from app.registry.events import EventLog
from app.registry.records import Decoded
from app.store import Entry

if TYPE_CHECKING:
    from app.registry.state import GroupState

# An agent gone within this much of its expiry instant counts as expired (clock granularity
# of the stores' sweeps), not as deregistered early.
SLACK_S = 1.0
ENDED_KEPT = 65_536  # agents whose expiry was recorded, remembered (a reload may end one again)


@dataclass(frozen=True, slots=True)
class Seen:
    engine_id: str
    host: str
    lease: int
    expires_at: float  # when first seen so; the group's last read has it since (_last)
    gone: bool = False  # remembered for its host after it went (and was counted)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Observer:
    def __init__(self, metrics: Metrics, events: EventLog) -> None:
        self.metrics = metrics
        self.events = events
        self._agents: dict[str, dict[int, Seen]] = {}
        self._last: dict[str, GroupState] = {}  # each group as last read
        self._not_ready_since: dict[str, tuple[str, float]] = {}
        # (lease, agent key) whose expiry was recorded, oldest first (a batch shares a lease)
        self._ended: dict[tuple[int, str], None] = {}

    def last_host(self, gid: str, engine_id: str, rank: int) -> str | None:
        """The host rank ``rank`` of this engine was on when last seen, if it was."""
        seen = self._agents.get(gid, {}).get(rank)
        return seen.host if seen is not None and seen.engine_id == engine_id else None

    def observe(self, states: list[GroupState], now: float | None = None) -> None:
        now = time.time() if now is None else now
        agents: dict[str, dict[int, Seen]] = {}
        last: dict[str, GroupState] = {}
        not_ready: dict[str, tuple[str, float]] = {}
        for state in states:
            engine = state.engine
            gid, eid = engine.group_id, engine.engine_id
            before = self._agents.get(gid, {})
            was = self._last.get(gid)
            if was is not None and was.agents is state.agents and was.engine is engine:
                seen = before  # the same version of the group (kept_states): nothing moved
            else:
                seen = self._compare(state, before, was, now)
            agents[gid] = seen
            last[gid] = state
            if state.missing:
                held = self._not_ready_since.get(gid)
                if held is not None and held[0] == eid:
                    not_ready[gid] = held
                elif gid in self._not_ready_since or gid in self._agents:
                    # a new generation: not ready since it opened
                    not_ready[gid] = (eid, min(now, _ts(engine.created_at)))
                else:
                    not_ready[gid] = (eid, now)  # first seen by this replica
        self._agents = agents
        self._last = last
        self._not_ready_since = not_ready
        longest = max((now - since for _, since in not_ready.values()), default=0.0)
        self.metrics.longest_not_ready.set(max(0.0, longest))

    def _compare(
        self, state: GroupState, before: dict[int, Seen], was: GroupState | None, now: float
    ) -> dict[int, Seen]:
        """A group that changed: each rank as now seen, expiries counted."""
        engine = state.engine
        eid = engine.engine_id
        seen = {r: Seen(eid, a.host, a.lease, state.expires_at[r]) for r, a in state.agents.items()}
        for rank, old in before.items():
            if old.gone:
                if rank not in seen and old.engine_id == eid:
                    seen[rank] = old
                continue
            # its expiry as of the last read (a group that did not change keeps its Seen)
            expiry = old.expires_at if was is None else was.expires_at.get(rank, old.expires_at)
            if old.engine_id != eid or expiry > now + SLACK_S:
                # superseded, or gone (deregistered) before its lease ran out
                if rank not in seen and old.engine_id == eid:
                    seen[rank] = replace(old, expires_at=expiry, gone=True)  # its host
                continue
            new = seen.get(rank)
            if new is None:
                self.metrics.lease_expiries.inc()  # its event: lease_ended
                seen[rank] = replace(old, expires_at=expiry, gone=True)
            elif new.lease != old.lease and expiry <= _ts(state.agents[rank].registered_at):
                self.metrics.lease_expiries.inc()  # its event: lease_ended
        return seen

    def lease_ended(self, entries: list[Entry], decoded: Decoded) -> None:
        """The store ended leases whose time ran out, with these entries: a ``lease_expired``
        event for each agent among them, now."""
        for entry in entries:
            parts = entry.key.split("/")
            if len(parts) != 4 or parts[0] != "groups" or parts[2] != "agents":
                continue  # a blob, say
            brief = decoded.brief(entry)
            if (brief.lease, entry.key) in self._ended:
                continue  # ended again after a failed commit's reload
            self._ended[(brief.lease, entry.key)] = None
            if len(self._ended) > ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
            gid, rank, host = parts[1], brief.rank, brief.host
            self.events.record(
                "lease_expired",
                gid,
                f"the lease of rank {rank} of group {gid!r} (generation {brief.generation}, host "
                f"{host}) expired: its process stopped renewing it (died, hung, or lost the "
                "network). Its agent is gone until the rank registers again.",
                (gid, brief.engine_id, rank, brief.lease),
                {
                    "rank": rank,
                    "host": host,
                    "engine_id": brief.engine_id,
                    "generation": brief.generation,
                },
            )
