"""What a decode rank must load from a prefill engine."""

from __future__ import annotations

import asyncio
from typing import Any

from app.core.budgets import clip
from app.core.errors import (
    FieldProblem,
    Incompatible,
    InvalidRequest,
    NotFound,
    NotReady,
)
from app.core.schemas import (
    Handshake,
    HandshakeRequest,
    Target,
)
from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.base import RegistryBase
from app.registry.records import AgentRecord, EngineRecord
from app.registry.state import GroupState
from app.registry.topology import TopologyError, plan_targets
from app.store import Entry
from registry_client import compat as compat_rules


class HandshakesMixin(RegistryBase):
    # -- handshake ---------------------------------------------------------------------------

    async def handshake(self, engine_id: str, req: HandshakeRequest) -> Handshake:
        """The targets of ``req``'s decode rank, each with its blob; from the watch feed when
        it is current (``app/registry/fresh.py``), else from the store's reads."""
        return await self._handshake(engine_id, req, await self._seen_now())

    async def _handshake(self, engine_id: str, req: HandshakeRequest, seen: bool) -> Handshake:
        state = await self.resolve(engine_id, seen=seen)
        engine = state.engine
        try:
            plan = plan_targets(engine.tp_size, req.tp_size, req.rank)
        except TopologyError as exc:
            raise InvalidRequest(
                f"decode TP {req.tp_size} cannot pair with prefill TP {engine.tp_size} of "
                f"engine {engine_id}: {exc}. The larger TP size must be a multiple of the "
                "smaller.",
                fields=[FieldProblem(("tp_size",), str(exc), "tp_ratio")],
            ) from None
        decode = None if req.decode is None else await self._decode_side(req, engine_id, seen)
        found: list[dict[str, Any]] = []
        if engine.role == "decode":
            found.append({"field": "role", "remote": "decode", "local": "decode"})
        if req.compat:
            # Each value shown once, cut to SHOWN_CHARS (docs/operations.md, budgets).
            found.extend(
                {"field": m["field"], "remote": clip(m["remote"]), "local": clip(m["local"])}
                for m in compat_rules.mismatches(engine.compat, req.compat)
            )
        if found:
            fields = ", ".join(m["field"] for m in found)
            error = Incompatible(
                f"engine {engine_id} (group {engine.group_id!r}) cannot serve this decode "
                f"rank: {fields} differ (mismatches has both values). Pair engines built "
                "from the same model and KV settings, and a prefill-capable role.",
                mismatches=found,
            )
            self.events.refusal(error, engine.group_id, engine_id=engine_id)
            raise error
        missing = [r for r in plan.target_ranks if r not in state.agents]
        texts: dict[int, str] = {}
        if not missing and seen:
            kept = await self._texts_as_seen(state, plan.target_ranks)
            if kept is None:  # the store's blobs are not the feed's agents': read it all
                return await self._handshake(engine_id, req, False)
            texts = kept
        elif not missing:
            by_rank = await self._blobs(engine.group_id, plan.target_ranks)
            texts = {r: self.decoded.base64(blob) for r, blob in by_rank.items()}
            missing = [r for r in plan.target_ranks if r not in by_rank]
        if missing:
            raise NotReady(
                f"target ranks {sorted(missing)} of engine {engine_id} (group "
                f"{engine.group_id!r}, generation {engine.generation}) have no live agent: "
                "they are starting, or died and their lease expired. Retry shortly, or "
                f"wait with GET /tp-groups/{engine.group_id}/engine?wait_ready=S.",
                missing_ranks=sorted(missing),
            )
        targets = self._targets(state, plan.target_ranks, texts)
        self.events.handshake(
            engine_id,
            engine.group_id,
            engine.generation,
            req.tp_size,
            req.rank,
            plan.target_ranks,
            decode,
        )
        return Handshake.model_construct(
            engine_id=engine.engine_id,
            group_id=engine.group_id,
            generation=engine.generation,
            remote_tp_size=engine.tp_size,
            tp_ratio=plan.tp_ratio,
            targets=targets,
        )

    @staticmethod
    def _targets(state: GroupState, ranks: list[int], texts: dict[int, str]) -> list[Target]:
        targets = []
        for r in ranks:
            agent = state.agents[r]
            assert isinstance(agent, AgentRecord)  # a group read whole (not briefs)
            targets.append(
                Target.model_construct(
                    rank=r,
                    agent_name=agent.agent_name,
                    agent_metadata=texts[r],
                    host=agent.host,
                    kv=agent.kv,
                    expires_at=utc_iso(state.expires_at[r]),
                )
            )
        return targets

    async def _decode_side(
        self, req: HandshakeRequest, engine_id: str, seen: bool
    ) -> dict[str, str]:
        """The asking decode side as verified: its group exists, may decode, and (when the
        request names one) ``decode.engine_id`` is that group's current engine. What the
        handshake event records is this, never the request's word. ``seen``: read from the
        current watch feed."""
        assert req.decode is not None
        gid = req.decode.group_id
        if seen and self.seen is not None:
            entry = self.seen.groups.get(gid, {}).get(keys.engine(gid))
        else:
            entry = await self.store.get(keys.engine(gid))
        if entry is None:
            raise NotFound(
                f"the decode group {gid!r} this handshake names (decode.group_id) does not "
                f"exist in this registry: the decode's rank 0 opens it (PUT /tp-groups/{gid}"
                "/engine) before its ranks handshake; check the decode's group id and registry "
                f"URL. The prefill engine {engine_id} itself exists.",
                decode_group_id=gid,
            )
        current = self.decoded.record(entry, EngineRecord)
        if current.role == "prefill":
            error = Incompatible(
                f"the decode group {gid!r} this handshake names (decode.group_id) is a prefill "
                "group: only a group of role decode or both loads from a prefill. Name the "
                "asking decode's own group.",
                mismatches=[{"field": "decode.role", "remote": "decode", "local": "prefill"}],
            )
            self.events.refusal(error, gid, engine_id=engine_id)
            raise error
        got = req.decode.engine_id
        if got is not None and got != current.engine_id:
            state = GroupState(current, entry.mod_revision, {}, {}, {}, entry.mod_revision)
            raise await self._mismatch(state, req.rank, got)
        return {"group_id": gid, "engine_id": current.engine_id}

    async def _texts_as_seen(self, state: GroupState, ranks: list[int]) -> dict[int, str] | None:
        """The base64 texts of ``ranks``' blobs, of the versions written with the agents
        ``state`` (read from the feed) shows: kept, else the group's blobs read (one range
        read, every text kept). None when a blob read is not its agent's version."""
        gid = state.engine.group_id
        wanted = {r: state.agent_revisions[r] for r in ranks}
        texts = {r: self.decoded.kept_base64(keys.blob(gid, r), at) for r, at in wanted.items()}
        if all(text is not None for text in texts.values()):
            return {r: text for r, text in texts.items() if text is not None}
        by_rank = {
            int(entry.key.rsplit("/", 1)[1]): entry
            for entry in (await self.store.range(f"blobs/{gid}/")).entries
        }
        if any(r not in by_rank or by_rank[r].mod_revision != at for r, at in wanted.items()):
            return None
        for rank, entry in by_rank.items():
            if state.agent_revisions.get(rank) == entry.mod_revision:
                self.decoded.base64(entry)  # kept for the group's next handshakes
        return {r: self.decoded.base64(by_rank[r]) for r in ranks}

    async def _blobs(self, gid: str, ranks: list[int]) -> dict[int, Entry]:
        """The metadata blobs of ``ranks``: a get each for a few, one range read for many
        (linear in the number of targets either way)."""
        if len(ranks) == 1:
            blob = await self.store.get(keys.blob(gid, ranks[0]))
            return {} if blob is None else {ranks[0]: blob}
        if len(ranks) <= 8:
            found = await asyncio.gather(*(self.store.get(keys.blob(gid, r)) for r in ranks))
            return {r: b for r, b in zip(ranks, found, strict=True) if b is not None}
        wanted = set(ranks)
        by_rank = {}
        for entry in (await self.store.range(f"blobs/{gid}/")).entries:
            rank = int(entry.key.rsplit("/", 1)[1])
            if rank in wanted:
                by_rank[rank] = entry
        return by_rank
