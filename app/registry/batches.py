"""Batches: every rank of a node (or of a group) registered in one request and one
transaction, and renewed by one heartbeat.

The ranks of a batch share one lease: they appear together, all or none (the first rank
that fails is named in the error), and they expire together unless renewed. The per-rank
routes stay for ranks that publish on their own.
"""

from __future__ import annotations

import time

from app.core.schemas import Agents, Heartbeats, RankExpiry, RegisterAgentsRequest, blob_of
from app.core.timefmt import utc_iso
from app.registry import blobs, keys
from app.registry.agents import AgentsMixin, _check_reachable
from app.registry.base import outside_group
from app.registry.races import LOST, Lost, until_won
from app.registry.records import AgentRecord, trusted
from app.registry.state import GroupState
from app.security.credentials import ACTOR
from app.store import Compare, Put


class BatchesMixin(AgentsMixin):
    async def register_agents(
        self, gid: str, req: RegisterAgentsRequest, client_host: str | None
    ) -> Agents:
        for i, item in enumerate(req.agents):
            _check_reachable(item.host, client_host, ("agents", i, "host"))
        raws = [blob_of(item.agent_metadata) for item in req.agents]
        stored = await blobs.stored_off_loop(raws, self.blob_codec)
        ttl_s = req.agents[0].ttl_s
        tries = 0

        async def attempt() -> Agents | Lost:
            # As one registration (``_current(writing=True)``): decided on pending changes (the
            # first try on etcd: on the watch feed, ``_seen_for_write``), refused only on
            # durable state.
            nonlocal tries
            tries += 1
            state = await self._seen_for_write(gid) if tries == 1 else None
            if state is None:
                state = await self._group_or_none(gid, settled=False)
            if state is None or not all(self._fits(state, i.rank, i.engine_id) for i in req.agents):
                state = await self._group(gid)
            engine = state.engine
            await self._check_batch(gid, state, req)
            lease = await self.store.grant_lease(ttl_s)
            now = time.time()
            actor = ACTOR.get()
            at = utc_iso(now)
            # Built from the validated request as is (``trusted``): validating it again
            # would only copy it.
            records = [
                trusted(
                    AgentRecord,
                    {
                        "rank": item.rank,
                        "engine_id": item.engine_id,
                        "generation": engine.generation,
                        "agent_name": item.agent_name,
                        "host": item.host,
                        "ttl_s": ttl_s,
                        "registered_at": at,
                        "lease": lease.id,
                        "registered_by": actor,
                        "kv": item.kv.model_dump(),
                    },
                )
                for item in req.agents
            ]
            compares = [Compare(keys.engine(gid), state.engine_revision)] + [
                Compare(keys.agent(gid, r.rank), state.agent_revisions.get(r.rank, 0))
                for r in records
            ]
            values = [keys.dump(record) for record in records]
            ops = [
                op
                for record, value, blob in zip(records, values, stored, strict=True)
                for op in (
                    Put(keys.agent(gid, record.rank), value, lease=lease.id),
                    Put(keys.blob(gid, record.rank), blob, lease=lease.id),
                )
            ]
            result = await self.store.txn(compares, ops)
            if not result.succeeded:
                await self.store.revoke_lease(lease.id)
                return LOST
            for record, value in zip(records, values, strict=True):
                self.decoded.remember(
                    keys.agent(gid, record.rank), result.revision, record, len(value)
                )
            batch = {r.rank for r in records}
            await self.release_leases(state, batch)
            expires = utc_iso(now + lease.remaining_s)
            return Agents.model_construct(
                agents=[self._agent_view_at(r, expires) for r in records],
                created_ranks=sorted(batch - state.agents.keys()),
                replaced_ranks=sorted(batch & state.agents.keys()),
            )

        return await until_won(attempt, f"Registering a batch in group {gid!r}")

    async def _check_batch(self, gid: str, state: GroupState, req: RegisterAgentsRequest) -> None:
        """Every rank of the batch in the group and of its current engine, else the first
        that is not is refused (nothing of the batch registered)."""
        engine = state.engine
        for i, item in enumerate(req.agents):
            if item.rank >= engine.tp_size:
                raise outside_group(
                    gid,
                    item.rank,
                    engine.tp_size,
                    ("agents", i, "rank"),
                    where=f" (agents[{i}])",
                    after="; nothing of the batch was registered",
                )
            if item.engine_id != engine.engine_id:
                raise await self._mismatch(state, item.rank, item.engine_id)

    async def heartbeat_agents(self, gid: str, engine_id: str, ranks: list[int]) -> Heartbeats:
        renewed = await self.renew_agents(gid, engine_id, ranks)
        return Heartbeats.model_construct(
            agents=[RankExpiry.model_construct(rank=r, expires_at=at) for r, at in renewed]
        )

    async def renew_agents(
        self, gid: str, engine_id: str, ranks: list[int]
    ) -> list[tuple[int, str]]:
        """A batch heartbeat: each rank with its lease's new expiry (the fast path writes it as
        ``Heartbeats`` does, without a model a rank:
        ``app.server.bypass.fastpath.heartbeats_json``)."""
        renewed = await self._renewals(gid, ranks, engine_id)
        now = time.time()
        expiry: dict[int, str] = {}
        for lease in renewed.values():  # a node's ranks share one lease: formatted once
            if lease.id not in expiry:
                expiry[lease.id] = utc_iso(now + lease.remaining_s)
        return [(r, expiry[renewed[r].id]) for r in ranks]
