"""A list page's kept views (app/watch/rendered.py) are the bytes of serializing each group's
view afresh, whatever the leases' time left, and follow every change to a group."""

from __future__ import annotations

import random

import pytest

from app.core.timefmt import utc_iso
from app.registry import keys
from app.registry.records import AgentRecord, Decoded, EngineRecord, ServingRecord
from app.store import Entry
from app.watch.feed import view
from app.watch.history import Group
from app.watch.pages import live
from app.watch.rendered import Rendered

pytestmark = pytest.mark.unit

GID = "prefill-000007"
# Names a serializer must escape, and one that holds the very text the views are cut at.
NAMES = ["e-1-rank0", 'quote"back\\slash', "ünïcödé \u2028 \x01", '"expires_at":""}', "]"]


def engine(
    generation: int = 1, tp: int = 4, compat: dict[str, object] | None = None, revision: int = 0
) -> Entry:
    """The engine's entry, written at ``revision`` (a store gives each write its own)."""
    record = EngineRecord(
        group_id=GID,
        engine_id=f"e-{generation}",
        generation=generation,
        launch_id="l",
        tp_size=tp,
        role="prefill",
        compat=compat or {"model": "m", "f": 0.5},
        created_at="2026-12-02T10:00:00.000Z",
    )
    return Entry(keys.engine(GID), record.model_dump_json().encode(), revision or generation * 100)


def agent(rank: int, revision: int, lease: int, generation: int = 1, name: str = "") -> Entry:
    record = AgentRecord(
        rank=rank,
        engine_id=f"e-{generation}",
        generation=generation,
        agent_name=name or f"e-{generation}-rank{rank}",
        host=f"10.0.0.{rank + 1}",
        ttl_s=30,
        registered_at="2026-12-02T10:00:01.000Z",
        lease=lease,
        kv={
            "mem_type": "DRAM",
            "device_id": rank,
            "base_addrs": [1, 2],
            "num_blocks": 4,
            "block_len": 64,
        },
    )
    return Entry(keys.agent(GID, rank), record.model_dump_json().encode(), revision, lease)


def serving(revision: int, generation: int = 1) -> Entry:
    record = ServingRecord(
        engine_id=f"e-{generation}",
        url="http://10.0.0.1:8000",
        model="m",
        dp_rank=None,
        bootstrap="10.0.0.1:8998",
        published_at="2026-12-02T10:00:02.000Z",
    )
    return Entry(keys.serving(GID), record.model_dump_json().encode(), revision)


def as_group(*entries: Entry) -> Group:
    return {e.key: e for e in entries}


def fresh(group: Group, remaining: dict[int, float], now: float) -> bytes | None:
    """What the page wrote before: the view made and serialized for this read."""
    shown = view(GID, live(group, remaining), 0, Decoded(), remaining, now)
    return None if shown is None else shown.__pydantic_serializer__.to_json(shown)


def test_kept_views_are_the_fresh_bytes_through_a_groups_changes() -> None:
    rng = random.Random(27)
    rendered = Rendered()
    versions: list[Group] = [
        as_group(engine()),  # opened, no agent yet
        as_group(engine(), agent(0, 101, lease=7)),
        as_group(engine(), *(agent(r, 102, lease=7) for r in range(4))),  # a node's batch
        as_group(engine(), *(agent(r, 102, lease=7) for r in range(3)), agent(3, 103, lease=9)),
        as_group(engine(), *(agent(r, 102, lease=7) for r in range(3))),  # rank 3 gone
        as_group(engine(), *(agent(r, 104, 8, name=n) for r, n in enumerate(NAMES[:4]))),
        as_group(
            engine(), *(agent(r, 104, 8, name=n) for r, n in enumerate(NAMES[:4])), serving(105)
        ),
        as_group(
            engine(2, compat={"model": NAMES[3]}),
            agent(0, 201, lease=11, generation=2, name=NAMES[4]),
        ),
        as_group(
            engine(2, tp=8, revision=250), agent(7, 202, lease=11, generation=2), serving(203, 1)
        ),
        as_group(agent(0, 301, lease=12)),  # no engine: not shown
    ]
    decoded = Decoded()
    for group in versions:
        for _ in range(4):  # the same version read again, leases at other times
            now = 1_764_670_000 + rng.uniform(0, 1e6)
            remaining = {
                lease: rng.choice([0.0, -1.0, 0.004, 12.5, 29.9994])
                for lease in range(6, 13)
                if rng.random() < 0.8
            }
            shown = live(group, remaining)
            assert rendered.json(GID, shown, decoded, remaining, now) == fresh(
                group, remaining, now
            ), (group.keys(), remaining)


def test_a_kept_view_serves_every_read_of_its_version() -> None:
    group = as_group(engine(), *(agent(r, 102, lease=7) for r in range(4)))
    rendered = Rendered()
    first = rendered.json(GID, group, Decoded(), {7: 10.0}, 1_764_670_000.0)
    kept = rendered._made[GID]
    again = rendered.json(GID, dict(group), Decoded(), {7: 20.0}, 1_764_670_000.0)
    assert rendered._made[GID] is kept  # not made again: the same version
    assert first is not None
    assert again is not None
    assert first.count(utc_iso(1_764_670_010.0).encode()) == 4
    assert again.count(utc_iso(1_764_670_020.0).encode()) == 4


def test_views_of_groups_gone_are_dropped_once_they_outnumber_the_fleet() -> None:
    rendered = Rendered()
    groups = {f"g{i:05d}": as_group(engine()) for i in range(3_000)}
    for gid, group in groups.items():
        rendered._made[gid] = None
        rendered.json(gid, group, Decoded(), {}, 0.0)
    rendered.trim(dict(list(groups.items())[:10]))
    assert len(rendered._made) == 10
