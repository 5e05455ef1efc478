"""Where instances serve: each engine's instance publishes its API's URL (withdrawn with the
engine: a new launch, a deletion, or its own withdrawal), so routers learn instances here."""

from __future__ import annotations

import time

from app.core.errors import StoreUnavailable
from app.core.schemas import Engine, ServingRequest
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.base import RegistryBase
from app.registry.records import MAX_ATTEMPTS, ServingRecord
from app.registry.state import GroupState
from app.security.credentials import ACTOR
from app.store import Compare, Delete, Put


class ServingMixin(RegistryBase):
    async def publish_serving(self, gid: str, req: ServingRequest) -> Engine:
        """Record where the current engine's instance serves; 409 when ``req.engine_id`` is
        not the current engine (an old launch must not advertise itself)."""
        for _ in range(MAX_ATTEMPTS):
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
            if result.succeeded:
                state.serving, state.serving_revision = record, result.revision
                return state.view()
        raise StoreUnavailable(f"Publishing where group {gid!r} serves lost too many races.")

    async def withdraw_serving(self, gid: str, engine_id: str) -> None:
        """The instance stops serving; a no-op when nothing (or another launch's) is there."""
        for _ in range(MAX_ATTEMPTS):
            state: GroupState = await self._group(gid)
            if engine_id != state.engine.engine_id:
                raise await self._mismatch(state, 0, engine_id)
            if state.serving is None:
                return
            result = await self.store.txn(
                [Compare(keys.engine(gid), state.engine_revision)],
                [Delete(keys.serving(gid))],
            )
            if result.succeeded:
                return
        raise StoreUnavailable(f"Withdrawing where group {gid!r} serves lost too many races.")
