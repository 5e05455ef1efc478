"""Where instances serve: each engine's instance publishes its API's URL (withdrawn with the
engine: a new launch, a deletion, or its own withdrawal), so routers learn instances here."""

from __future__ import annotations

import time

from app.core.schemas import Engine, ServingRequest
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.base import RegistryBase
from app.registry.races import LOST, Lost, until_won
from app.registry.records import ServingRecord
from app.registry.state import GroupState
from app.security.credentials import ACTOR
from app.store import Compare, Delete, Put


class ServingMixin(RegistryBase):
    async def publish_serving(self, gid: str, req: ServingRequest) -> Engine:
        """Record where the current engine's instance serves; 409 when ``req.engine_id`` is
        not the current engine (an old launch must not advertise itself)."""

        async def attempt() -> Engine | Lost:
            state = await self._group(gid)
            if req.engine_id != state.engine.engine_id:
                raise await self._mismatch(state, 0, req.engine_id)
            record = ServingRecord(
                engine_id=req.engine_id,
                url=req.url,
                model=req.model,
                dp_rank=req.dp_rank,
                bootstrap=req.bootstrap,
                published_at=utc_iso(time.time()),
                published_by=ACTOR.get(),
            )
            result = await self.store.txn(
                [Compare(keys.engine(gid), state.engine_revision)],
                [Put(keys.serving(gid), keys.dump(record))],
            )
            if not result.succeeded:
                return LOST
            state.serving, state.serving_revision = record, result.revision
            return state.view()

        return await until_won(attempt, f"Publishing where group {gid!r} serves")

    async def withdraw_serving(self, gid: str, engine_id: str) -> None:
        """The instance stops serving; a no-op when nothing (or another launch's) is there."""

        async def attempt() -> Lost | None:
            state: GroupState = await self._group(gid)
            if engine_id != state.engine.engine_id:
                raise await self._mismatch(state, 0, engine_id)
            if state.serving is None:
                return None
            result = await self.store.txn(
                [Compare(keys.engine(gid), state.engine_revision)],
                [Delete(keys.serving(gid))],
            )
            return None if result.succeeded else LOST

        await until_won(attempt, f"Withdrawing where group {gid!r} serves")
