"""The parsed-records cache (``app.registry.records._Cache``) at its budget: the oldest
insertion goes first, the bytes it holds stay within the budget and are counted right,
and a group's keys go with the group. A fleet's records exceed the budget, so it evicts on
every insertion (its speed there is measured in bench/, not asserted here)."""

from __future__ import annotations

import pytest

from app.registry.records import _Cache

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
