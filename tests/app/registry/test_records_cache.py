"""The parsed-records cache (``app.registry.records._Cache``) at its budget: the oldest
insertion goes first, the bytes it holds stay within the budget and are counted right,
and a group's keys go with the group. A fleet's records exceed the budget, so it evicts on
every insertion (its speed there is measured in bench/, not asserted here)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from app.registry.records import (
    BRIEF_BYTES,
    AgentBrief,
    AgentRecord,
    Decoded,
    EngineRecord,
    _Cache,
    trusted,
)
from app.store import Entry

pytestmark = pytest.mark.unit


def _key(i: int) -> str:
    return f"groups/g{i % 50:03d}/agents/{i:05d}"


def test_at_its_budget_the_cache_drops_the_oldest_first_and_counts_its_bytes() -> None:
    cache = _Cache(budget=10_000)
    for i in range(5_000):  # 100 bytes each: at most the newest 100 fit
        cache.put(_key(i), i, f"value-{i}", 100, f"g{i % 50:03d}")
        assert cache.bytes <= 10_000
    assert len(cache) == 100
    assert cache.bytes == 100 * 100
    assert [cache.get(_key(i), i) for i in range(4_900, 5_000)] == [
        f"value-{i}" for i in range(4_900, 5_000)
    ]
    assert cache.get(_key(4_899), 4_899) is None


def test_a_replaced_key_moves_to_the_back_and_a_forgotten_group_leaves_nothing() -> None:
    cache = _Cache(budget=300)
    for i in range(3):
        cache.put(_key(i), 1, i, 100, f"g{i:03d}")
    cache.put(_key(0), 2, "new", 100, "g000")  # a new version of the oldest key
    cache.put(_key(3), 1, 3, 100, "g003")  # over budget: key 1 is now the oldest
    assert cache.get(_key(0), 2) == "new"
    assert cache.get(_key(1), 1) is None
    assert cache.get(_key(2), 1) == 2
    cache.forget("g002")
    assert cache.get(_key(2), 1) is None
    assert (len(cache), cache.bytes) == (2, 200)
    cache.put(_key(4), 1, "big", 301, "g004")  # larger than the budget: not kept
    assert cache.get(_key(4), 1) is None
    assert (len(cache), cache.bytes) == (2, 200)


def test_briefs_of_agents_are_kept_apart_from_their_whole_records() -> None:
    """At a fleet's size the agents' records outgrow their cache; the briefs (no ``kv``) that
    heartbeats, listings and the status page need are kept apart, and the engines too."""
    agent = AgentRecord(
        rank=3,
        engine_id="e1",
        generation=1,
        agent_name="a",
        host="10.0.0.1",
        kv={"base_addrs": list(range(80))},
        ttl_s=30,
        registered_at="t",
        lease=42,
    )
    engine = EngineRecord(
        group_id="g",
        engine_id="e1",
        generation=1,
        launch_id="l",
        tp_size=8,
        role="prefill",
        compat={},
        created_at="t",
    )
    decoded = Decoded(records_bytes=1)  # no agent record fits: every one is parsed anew
    a = Entry("groups/g/agents/3", agent.model_dump_json().encode(), 5, 42)
    e = Entry("groups/g/engine", engine.model_dump_json().encode(), 4, None)
    brief = decoded.brief(a)
    assert type(brief) is AgentBrief
    assert brief.model_dump() == agent.model_dump(exclude={"kv"})
    assert decoded.record(e, EngineRecord) == engine
    assert decoded.record(a, AgentRecord) == agent  # parsed whole, not kept
    records, _ = decoded.sizes()
    assert records == BRIEF_BYTES + len(e.value), "the brief and the engine, no agent record"
    assert decoded.brief(a) == brief
    moved = Entry(a.key, a.value.replace(b'"lease":42', b'"lease":43'), 6, 43)
    assert decoded.brief(moved).lease == 43, "a new version is read again"
    decoded.forget("g", keep_engines=True)
    assert decoded.sizes()[0] == len(e.value), "a relaunch drops the agents' briefs"


def test_a_trusted_record_is_the_model_construct_one_and_wrong_fields_are_refused() -> None:
    """``trusted`` (a launch's records, briefs and answers) builds what ``model_construct``
    does: equal, the same JSON, the same fields set; values that miss or add a field, and
    models with aliases or extra fields, are refused rather than built wrong."""
    values: dict[str, Any] = {
        "rank": 3,
        "engine_id": "e-1",
        "generation": 2,
        "agent_name": "a-3",
        "host": "10.0.0.3",
        "ttl_s": 30,
        "registered_at": "2026-12-04T03:00:00.000000Z",
        "lease": 7,
        "registered_by": None,
        "kv": {"mem_type": "VRAM", "base_addrs": [1, 2]},
    }
    built, reference = trusted(AgentRecord, dict(values)), AgentRecord.model_construct(**values)
    assert built == reference
    assert built.model_dump_json() == reference.model_dump_json()
    assert built.model_fields_set == reference.model_fields_set
    assert AgentRecord.model_validate_json(built.model_dump_json()) == reference
    brief = {k: v for k, v in values.items() if k != "kv"}
    assert trusted(AgentBrief, dict(brief)) == AgentBrief.model_construct(**brief)
    with pytest.raises(ValueError, match="takes"):
        trusted(AgentBrief, dict(values))  # kv is not a brief's
    with pytest.raises(ValueError, match="takes"):
        trusted(AgentRecord, dict(brief))  # kv missing

    class Aliased(BaseModel):
        name: str = Field(alias="n")

    with pytest.raises(ValueError, match="model_construct"):
        trusted(Aliased, {"name": "x"})
