"""vLLM's MooncakeConnector bootstrap protocol, answered from the store (docs/api.md
"Mooncake bootstrap").

A prefill worker posts ``{engine_id, dp_rank, tp_rank, pp_rank, addr}``; a decode reads one
engine's workers. The engine id names the group: one this registry issued (the vLLM plugin
opened it), or ``<group>~<launch>`` (a plain vLLM given that ``engine_id``), which opens a new
generation of the group when it is new, in the same transaction that writes the entry and
deletes the older generation's. Entries end with their engine (superseded, group deleted);
those of an issued engine are answered only while their rank's agent holds its lease (the
plugin's node renews it), so a dead prefill leaves ``/query`` within its ttl.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from app.core.errors import NotFound
from app.core.schemas import GROUP_ID_PATTERN, MooncakeRegistration, OpenEngineRequest
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.engines import EnginesMixin
from app.registry.races import LOST, Lost, until_won
from app.registry.records import MooncakeRecord
from app.store import Compare, Put

GROUP_SEPARATOR = "~"  # in engine ids, never in group ids
_GROUP = re.compile(GROUP_ID_PATTERN)


def base_engine_id(engine_id: str, dp_rank: int) -> str:
    """The engine's id without vLLM's data-parallel suffix (``_dp{rank}``, added per DP rank
    to the configured id)."""
    suffix = f"_dp{dp_rank}"
    return engine_id[: -len(suffix)] if engine_id.endswith(suffix) else engine_id


def named_group(engine_id: str) -> str | None:
    """The group a plain vLLM's ``<group>~<launch>`` engine id names, else None."""
    gid, sep, launch = engine_id.partition(GROUP_SEPARATOR)
    return gid if sep and launch and _GROUP.match(gid) else None


class MooncakeMixin(EnginesMixin):
    async def mooncake_register(
        self, req: MooncakeRegistration, check_group: Callable[[str], None]
    ) -> str:
        """Record one prefill worker; returns its group. ``check_group``: the caller's token
        scope check, run once the group is known. 404 for an engine id that names no group,
        410 for a superseded one (an old launch's worker)."""
        base = base_engine_id(req.engine_id, req.dp_rank)

        async def attempt() -> str | Lost:
            if await self._index(base) is not None:
                state = await self.resolve(base)  # 404 (group deleted) or 410 (superseded)
                gid = state.engine.group_id
                check_group(gid)
                put = self._mooncake_put(gid, req)
                result = await self.store.txn(
                    [Compare(keys.engine(gid), state.engine_revision)], [put]
                )
                return gid if result.succeeded else LOST
            gid = named_group(base) or ""
            if not gid:
                raise NotFound(
                    f"engine_id {req.engine_id!r} was never issued by this registry and names "
                    f"no group: run the prefill with the engine-registry plugin, or give vLLM "
                    f'kv_transfer_config "engine_id": "<group>{GROUP_SEPARATOR}<launch>" '
                    "with a new <launch> at every start."
                )
            check_group(gid)
            return gid if await self._open_for(gid, base, req) else LOST

        return await until_won(attempt, f"Registering a Mooncake worker of {base!r}")

    async def _open_for(self, gid: str, base: str, req: MooncakeRegistration) -> bool:
        """A plain vLLM's new launch: its engine opened as the group's next generation, the
        older generation's agents and Mooncake entries deleted and this worker's entry
        written, in one transaction; False when it lost a race (the caller re-reads)."""
        state = await self._group_or_none(gid)
        if state is not None and state.engine.engine_id == base:
            return False  # another worker of this launch opened it since the caller looked
        opened = await self._write_open(
            gid,
            OpenEngineRequest(launch_id=base, tp_size=1, role="prefill", compat={}),
            state.engine if state else None,
            state.engine_revision if state else 0,
            [a.lease for a in state.agents.values()] if state else [],
            engine_id=base,
            also=[self._mooncake_put(gid, req)],
        )
        return opened is not None

    @staticmethod
    def _mooncake_put(gid: str, req: MooncakeRegistration) -> Put:
        record = MooncakeRecord(
            engine_id=req.engine_id,
            dp_rank=req.dp_rank,
            tp_rank=req.tp_rank,
            pp_rank=req.pp_rank,
            addr=req.addr,
            registered_at=utc_iso(time.time()),
        )
        base = base_engine_id(req.engine_id, req.dp_rank)
        key = keys.mooncake(gid, base, req.dp_rank, req.tp_rank, req.pp_rank)
        return Put(key, keys.dump(record))

    async def mooncake_query(self, engine_id: str) -> dict[str, Any]:
        """The current engine's live workers as vLLM's bootstrap server answers
        (``{dp_rank: {engine_id, worker_addr: {tp_rank: {pp_rank: addr}}}}``); 404 for an
        unknown engine id, 410 for a superseded one, so a decode fails the request at once."""
        state = await self.resolve(engine_id)
        snap = await self.store.range(keys.mooncake_prefix(state.engine.group_id, engine_id))
        records = [MooncakeRecord.model_validate_json(e.value) for e in snap.entries]
        # An engine the registry issued (the plugin's) has agents with leases: a worker is
        # live while its rank's agent is. A plain vLLM's engine (its launch id is its engine
        # id) has none: its workers live until the engine is superseded or its group deleted.
        issued = state.engine.launch_id != state.engine.engine_id
        pp_size = 1 + max((r.pp_rank for r in records), default=0)
        tp_size = max(1, state.engine.tp_size // pp_size)
        answer: dict[str, Any] = {}
        for record in records:
            if base_engine_id(record.engine_id, record.dp_rank) != engine_id:
                continue  # written for another generation: never the case, but be strict
            if issued and record.pp_rank * tp_size + record.tp_rank not in state.agents:
                continue  # its rank's agent is gone (lease ended, deregistered) or not yet in
            dp = answer.setdefault(
                str(record.dp_rank), {"engine_id": record.engine_id, "worker_addr": {}}
            )
            dp["worker_addr"].setdefault(str(record.tp_rank), {})[str(record.pp_rank)] = record.addr
        return answer
