"""A rank's agent: register, renew, deregister."""

from __future__ import annotations

import time

from app.core.addresses import parse_host
from app.core.errors import (
    FieldPath,
    FieldProblem,
    InvalidRequest,
)
from app.core.schemas import (
    Agent,
    Heartbeat,
    RegisterAgentRequest,
    blob_of,
)
from app.core.timefmt import utc_iso
from app.registry import blobs, keys
from app.registry.races import LOST, Lost, until_won
from app.registry.records import AgentRecord, trusted
from app.registry.renewals import RenewalsMixin
from app.security.credentials import ACTOR
from app.store import Compare, Delete, Put


class AgentsMixin(RenewalsMixin):
    # -- agents ------------------------------------------------------------------------------

    async def register_agent(
        self, gid: str, rank: int, req: RegisterAgentRequest, client_host: str | None
    ) -> tuple[Agent, bool]:
        _check_reachable(req.host, client_host)
        (blob,) = await blobs.stored_off_loop([blob_of(req.agent_metadata)], self.blob_codec)

        async def attempt() -> tuple[Agent, bool] | Lost:
            state = await self._current(gid, rank, req.engine_id, writing=True)
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
                registered_by=ACTOR.get(),
            )
            value = keys.dump(record)
            result = await self.store.txn(
                [
                    Compare(keys.engine(gid), state.engine_revision),
                    Compare(keys.agent(gid, rank), state.agent_revisions.get(rank, 0)),
                ],
                [
                    Put(keys.agent(gid, rank), value, lease=lease.id),
                    Put(keys.blob(gid, rank), blob, lease=lease.id),
                ],
            )
            if not result.succeeded:
                await self.store.revoke_lease(lease.id)
                return LOST
            self.decoded.remember(keys.agent(gid, rank), result.revision, record, len(value))
            await self.release_leases(state, {rank})
            return self._agent_view(record, now + lease.remaining_s), old is None

        return await until_won(attempt, f"Registering rank {rank} of {gid!r}")

    @classmethod
    def _agent_view(cls, record: AgentRecord, expires_at: float) -> Agent:
        return cls._agent_view_at(record, utc_iso(expires_at))

    @staticmethod
    def _agent_view_at(record: AgentRecord, expires_at: str) -> Agent:
        return trusted(
            Agent,
            {
                "engine_id": record.engine_id,
                "generation": record.generation,
                "rank": record.rank,
                "agent_name": record.agent_name,
                "host": record.host,
                "kv": record.kv,
                "ttl_s": record.ttl_s,
                "registered_at": record.registered_at,
                "registered_by": record.registered_by,
                "expires_at": expires_at,
            },
        )

    async def heartbeat(self, gid: str, rank: int, engine_id: str) -> Heartbeat:
        lease = (await self._renewals(gid, [rank], engine_id, ("rank",)))[rank]
        return Heartbeat.model_construct(expires_at=utc_iso(time.time() + lease.remaining_s))

    async def deregister(self, gid: str, rank: int, engine_id: str) -> None:
        async def attempt() -> Lost | None:
            state = await self._current(gid, rank, engine_id, writing=True)
            if rank not in state.agents:  # an answer: decided on durable state
                state = await self._current(gid, rank, engine_id)
            agent = state.agents.get(rank)
            if agent is None:
                raise self._absent(gid, rank)
            result = await self.store.txn(
                [Compare(keys.agent(gid, rank), state.agent_revisions[rank])],
                [Delete(keys.agent(gid, rank)), Delete(keys.blob(gid, rank))],
            )
            if not result.succeeded:
                return LOST  # registered again meanwhile: deregister what is there now
            await self.release_leases(state, {rank})
            return None

        await until_won(attempt, f"Deregistering rank {rank} of {gid!r}")


def _check_reachable(host: str, client_host: str | None, field: FieldPath = ("host",)) -> None:
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
            fields=[FieldProblem(field, "loopback host from a remote client", "unreachable_host")],
        )
