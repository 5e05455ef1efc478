"""``GET /instances``: the instances ready to serve, for routers (docs/api.md "Instances").

An instance is a group whose current engine is ready (every rank's lease live) and has
published where it serves (``PUT /tp-groups/{id}/engine/serving``). Read like ``GET
/tp-groups``: from the feed, one snapshot walked in pages (``limit``, ``continue``); filtered
by ``role`` (``both`` counts as either) and ``model``. To follow them, watch ``/tp-groups``:
its events carry the same fields (``ready``, ``serving``).
"""

from __future__ import annotations

import json
from typing import Any

from app.core.schemas import Engine
from app.registry import keys
from app.registry.records import Decoded, EngineRecord, ServingRecord
from app.store import Store
from app.watch.feed import Feed
from app.watch.pages import encode_token, snapshot, taken, views


def instance(engine: Engine) -> dict[str, Any]:
    """One ready, serving engine as ``GET /instances`` lists it."""
    serving = engine.serving
    assert serving is not None
    return {
        "group_id": engine.group_id,
        "engine_id": engine.engine_id,
        "generation": engine.generation,
        "role": engine.role,
        "tp_size": engine.tp_size,
        "url": serving.url,
        "model": serving.model,
        "dp_rank": serving.dp_rank,
        "bootstrap": serving.bootstrap,
        "compat": engine.compat,
        "published_at": serving.published_at,
    }


def _wanted(role: str | None, model: str | None, engine: EngineRecord, s: ServingRecord) -> bool:
    if s.engine_id != engine.engine_id:
        return False
    if role is not None and engine.role not in (role, "both"):
        return False
    return model is None or s.model == model


async def read_instances(
    feed: Feed,
    store: Store,
    decoded: Decoded,
    *,
    role: str | None,
    model: str | None,
    limit: int,
    token: str | None,
    timeout_s: float,
) -> bytes:
    """A page: ``{"instances": [...], "revision", "continue"}`` (JSON bytes)."""
    selector = json.dumps([role, model])
    revision, after, groups = await snapshot(
        feed, token=token, selector=selector, timeout_s=timeout_s
    )
    candidates: list[str] = []
    for gid in sorted(g for g in groups if g > after):
        engine_entry = groups[gid].get(keys.engine(gid))
        serving_entry = groups[gid].get(keys.serving(gid))
        if engine_entry is None or serving_entry is None:
            continue
        record = decoded.record(engine_entry, EngineRecord)
        if _wanted(role, model, record, decoded.record(serving_entry, ServingRecord)):
            candidates.append(gid)
    mine = taken(groups, candidates)  # before the awaits below: the feed's groups change
    found: list[dict[str, Any]] = []
    last = ""  # the last group this page consumed: the next page starts after it
    more = False
    for start in range(0, len(candidates), limit):
        for engine in await views(
            store, decoded, mine, candidates[start : start + limit], revision
        ):
            if engine.ready and engine.serving is not None:
                if len(found) == limit:
                    more = True
                    break
                found.append(instance(engine))
            last = engine.group_id
        if more:
            break
    follow = json.dumps(encode_token(revision, last, selector)) if more else "null"
    return b'{"instances":%s,"revision":%d,"continue":%s}' % (
        json.dumps(found, separators=(",", ":")).encode(),
        revision,
        follow.encode(),
    )
