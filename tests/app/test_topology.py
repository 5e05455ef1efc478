from __future__ import annotations

import pytest

from app.registry.topology import TopologyError, plan_targets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("remote", "local", "rank", "ratio", "targets"),
    [
        (4, 4, 2, 1, [2]),
        (2, 4, 0, 2, [0]),
        (2, 4, 1, 2, [0]),
        (2, 4, 3, 2, [1]),
        (1, 8, 7, 8, [0]),
        (4, 2, 0, -2, [0, 1]),
        (4, 2, 1, -2, [2, 3]),
        (8, 1, 0, -8, list(range(8))),
        (8, 2, 1, -4, [4, 5, 6, 7]),
    ],
)
def test_plan_follows_the_vllm_nixl_convention(
    remote: int, local: int, rank: int, ratio: int, targets: list[int]
) -> None:
    plan = plan_targets(remote, local, rank)
    assert plan.tp_ratio == ratio
    assert plan.target_ranks == targets


def test_every_remote_rank_is_read_by_some_decode_rank() -> None:
    for remote, local in [(8, 2), (2, 8), (4, 4), (8, 1)]:
        covered = {t for r in range(local) for t in plan_targets(remote, local, r).target_ranks}
        assert covered == set(range(remote))


@pytest.mark.parametrize(("remote", "local"), [(4, 3), (3, 4), (6, 4)])
def test_sizes_that_do_not_divide_are_refused(remote: int, local: int) -> None:
    with pytest.raises(TopologyError, match="multiple"):
        plan_targets(remote, local, 0)


def test_rank_outside_the_decode_group_is_refused() -> None:
    with pytest.raises(TopologyError, match="outside"):
        plan_targets(2, 2, 2)
