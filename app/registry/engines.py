"""Engines: one per launch of a group; opening, supersession, deletion."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence

from app.core.budgets import clip
from app.core.errors import (
    GroupConflict,
    LaunchSuperseded,
)
from app.core.schemas import (
    Engine,
    OpenEngineRequest,
)
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.base import RegistryBase
from app.registry.races import LOST, Lost, until_won
from app.registry.records import EngineRecord, IndexRecord
from app.registry.state import GroupState
from app.security.credentials import ACTOR
from app.store import Compare, Delete, Put, Unavailable
from registry_client import compat as compat_rules


class EnginesMixin(RegistryBase):
    # -- engines -----------------------------------------------------------------------------

    async def open_engine(self, gid: str, req: OpenEngineRequest) -> tuple[Engine, bool]:
        """Open the engine of ``req.launch_id``; returns (engine, created)."""
        if self.store.remote_reads:
            opened = await self._open_as_seen(gid, req)
            if opened is not None:
                return opened, True

        async def attempt() -> tuple[Engine, bool] | Lost:
            snap = await self.store.range(keys.group_prefix(gid))
            state = GroupState.read(snap, gid, self.decoded)
            if state is not None and state.engine.launch_id == req.launch_id:
                self._check_same_launch(gid, state.engine, req)
                return state.view(), False
            launch_key = _launch_key(gid, req.launch_id)
            launch = await self.store.get(launch_key)
            if launch is not None and launch.mod_revision > snap.revision:
                return LOST  # a concurrent open wrote it after our read: re-read, maybe ours
            if launch is not None:
                seen = IndexRecord.model_validate_json(launch.value)
                current_gen = state.engine.generation if state else seen.generation
                error = LaunchSuperseded(
                    f"launch {req.launch_id!r} opened generation {seen.generation} of group "
                    f"{gid!r}, which a newer launch superseded (current generation "
                    f"{current_gen}). This process belongs to an old launch: stop it, or "
                    "restart it so that it makes a new launch_id.",
                    current_generation=current_gen,
                )
                self.events.refusal(error, gid, launch_id=req.launch_id)
                raise error
            opened = await self._write_open(
                gid,
                req,
                state.engine if state else None,
                state.engine_revision if state else 0,
                [a.lease for a in state.agents.values()] if state else [],
            )
            return LOST if opened is None else (opened, True)

        return await until_won(attempt, f"Opening an engine for group {gid!r}")

    async def _open_as_seen(self, gid: str, req: OpenEngineRequest) -> Engine | None:
        """A new launch decided on the replica's watch feed instead of two reads of the store
        (``Store.remote_reads``: on etcd two linearizable reads, which under a fleet's launch
        took 4-5 times a write's time). The write's compares (the engine's key at the revision
        the feed shows, absent if it shows none; the launch's key absent) hold exactly when a
        read of the store would have shown the same engine and no such launch, so it is the
        write that read would have led to, or it fails and the caller reads (a feed behind,
        a launch seen before). The same launch again (a retried open) is always read: the
        feed may not show that it was superseded."""
        seen = self.seen
        if seen is None or not seen.following:
            return None
        group = seen.groups.get(gid, {})
        entry = group.get(keys.engine(gid))
        current = None if entry is None else self.decoded.record(entry, EngineRecord)
        if current is not None and current.launch_id == req.launch_id:
            return None
        agents = keys.agent_prefix(gid)
        leases = [self.decoded.brief(e).lease for k, e in group.items() if k.startswith(agents)]
        revision = 0 if entry is None else entry.mod_revision
        return await self._write_open(gid, req, current, revision, leases)

    async def _write_open(
        self,
        gid: str,
        req: OpenEngineRequest,
        current: EngineRecord | None,
        engine_revision: int,
        leases: list[int],
        engine_id: str | None = None,
        also: Sequence[Put] = (),
    ) -> Engine | None:
        """The new engine written if the group's engine is still ``current`` (at
        ``engine_revision``) and the launch never opened before; None when either fails.
        ``engine_id``: one the launch chose (a Mooncake registration's, never issued before);
        ``also``: written in the same transaction (that registration's entry)."""
        generation = 1 if current is None else current.generation + 1
        engine = EngineRecord(
            group_id=gid,
            engine_id=engine_id or str(uuid.uuid4()),
            generation=generation,
            launch_id=req.launch_id,
            tp_size=req.tp_size,
            role=req.role,
            compat=req.compat or {},
            created_at=utc_iso(time.time()),
            opened_by=ACTOR.get(),
        )
        index = IndexRecord(group_id=gid, generation=generation, engine_id=engine.engine_id)
        engine_json, index_json = keys.dump(engine), keys.dump(index)
        launch_key = _launch_key(gid, req.launch_id)
        compares = [Compare(keys.engine(gid), engine_revision), Compare(launch_key, 0)]
        if engine_id is not None:
            compares.append(Compare(f"engines/{engine_id}", 0))
        gone = [] if current is None else [keys.mooncake_prefix(gid, current.engine_id)]
        result = await self.store.txn(
            compares,
            [
                Put(keys.engine(gid), engine_json),
                Put(launch_key, index_json),
                Put(f"engines/{engine.engine_id}", index_json),
                Delete(keys.agent_prefix(gid), prefix=True),
                Delete(f"blobs/{gid}/", prefix=True),
                Delete(keys.serving(gid)),  # the old launch's instance serves no more
                *(Delete(prefix, prefix=True) for prefix in gone),  # its Mooncake workers
                *also,
            ],
        )
        if not result.succeeded:
            return None
        self.decoded.forget(gid, keep_engines=True)  # its agents and blobs are gone
        if current is not None:
            self.events.forget_engines([current.engine_id])
        self.decoded.remember(keys.engine(gid), result.revision, engine, len(engine_json))
        self.decoded.remember(
            f"engines/{engine.engine_id}", result.revision, index, len(index_json)
        )
        self.metrics.engines_opened.inc()
        if current is not None:
            await self._revoke_quietly(leases)
        return GroupState(engine, result.revision, {}, {}, {}, result.revision).view()

    async def _revoke_quietly(self, leases: Iterable[int]) -> None:
        """End the superseded agents' leases now, so that a heartbeat racing the open cannot
        renew them. Their keys are already gone; a failure here leaves them to expire."""
        for lease in leases:
            try:
                await self.store.revoke_lease(lease)
            except Unavailable:
                return

    @staticmethod
    def _check_same_launch(gid: str, current: EngineRecord, req: OpenEngineRequest) -> None:
        diffs = []
        if current.tp_size != req.tp_size:
            diffs.append(f"tp_size {req.tp_size} (open engine has {current.tp_size})")
        if current.role != req.role:
            diffs.append(f"role {req.role!r} (open engine has {current.role!r})")
        if req.compat is not None and not compat_rules.equal(current.compat, req.compat):
            differ = [m["field"] for m in compat_rules.mismatches(current.compat, req.compat)]
            one_sided = sorted(current.compat.keys() ^ req.compat.keys())
            diffs.append(
                f"compat differs (values of {', '.join(map(repr, differ)) or 'none'}; keys in "
                f"one side only: {', '.join(repr(clip(k, 32)) for k in one_sided) or 'none'})"
            )
        if diffs:
            raise GroupConflict(
                f"launch {req.launch_id!r} already opened generation {current.generation} of "
                f"group {gid!r} with other settings: {'; '.join(diffs)}. Two different "
                "deployments share this group id, or a launch_id was reused: give each "
                "deployment its own group id and each process start a fresh launch_id."
            )

    async def delete_group(self, gid: str) -> None:
        async def attempt() -> Lost | None:
            state = await self._group(gid)
            launches = await self.store.range(f"launches/{gid}/")
            engine_ids = {
                IndexRecord.model_validate_json(e.value).engine_id for e in launches.entries
            }
            engine_ids.add(state.engine.engine_id)
            ops = [
                Delete(keys.group_prefix(gid), prefix=True),
                Delete(f"launches/{gid}/", prefix=True),
                Delete(f"blobs/{gid}/", prefix=True),
                Delete(keys.mooncake_prefix(gid), prefix=True),
                *(Delete(f"engines/{eid}") for eid in sorted(engine_ids) if eid),
            ]
            result = await self.store.txn([Compare(keys.engine(gid), state.engine_revision)], ops)
            if not result.succeeded:
                return LOST
            self.decoded.forget(gid)  # nothing is kept for a group that is gone
            self.events.forget_engines(engine_ids)
            return None

        await until_won(attempt, f"Deleting group {gid!r}")


def _launch_key(gid: str, launch_id: str) -> str:
    return f"launches/{gid}/{launch_id}"
