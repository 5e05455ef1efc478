"""KV layout, content and the heterogeneous-TP read plan, executed with plain memory copies.

`execute` carries out a plan's descriptors with `ctypes.memmove` between real tensors: the
same bytes a NIXL READ would move, so the plan's arithmetic is checked without any transport.
"""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from workers.kv import KvLayout, ReadOp, engine_seed, fill, kv_spec, pattern, plan_reads, verify

pytestmark = pytest.mark.workers

LAYOUT = KvLayout(num_layers=2, num_blocks=5, block_size=4, num_heads=4, head_size=8)
REMOTE_BLOCKS = [4, 2, 0]


def prefill_caches(engine_id: str, tp: int) -> list[torch.Tensor]:
    caches = []
    for rank in range(tp):
        cache = LAYOUT.allocate(tp, LAYOUT.num_blocks)
        fill(cache, engine_id, LAYOUT, tp, rank)
        caches.append(cache)
    return caches


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


def plan_for(
    caches: list[torch.Tensor], local_tp: int, rank: int, buffer: torch.Tensor
) -> list[ReadOp]:
    remote_tp = len(caches)
    ratio = tp_ratio(local_tp, remote_tp)
    wanted = [rank // ratio] if ratio > 0 else [rank * -ratio + k for k in range(-ratio)]
    return plan_reads(
        LAYOUT,
        local_tp=local_tp,
        local_rank=rank,
        local=kv_spec(buffer, LAYOUT.local_heads(local_tp)),
        remote_tp=remote_tp,
        tp_ratio=ratio,
        targets={r: kv_spec(caches[r], LAYOUT.local_heads(remote_tp)) for r in wanted},
        local_block_ids=list(range(len(REMOTE_BLOCKS))),
        remote_block_ids=REMOTE_BLOCKS,
    )


def execute(ops: list[ReadOp]) -> None:
    for op in ops:
        for (dst, length, _), (src, remote_length, _) in zip(op.local, op.remote, strict=True):
            assert length == remote_length
            ctypes.memmove(dst, src, length)


@pytest.mark.parametrize(
    ("remote_tp", "local_tp"),
    [(1, 1), (2, 2), (1, 2), (1, 4), (2, 4), (2, 1), (4, 1), (4, 2)],
)
def test_every_decode_rank_reads_exactly_its_heads_of_the_chosen_blocks(
    remote_tp: int, local_tp: int
) -> None:
    caches = prefill_caches("engine-a", remote_tp)
    for rank in range(local_tp):
        buffer = LAYOUT.allocate(local_tp, len(REMOTE_BLOCKS))
        ops = plan_for(caches, local_tp, rank, buffer)
        execute(ops)
        moved = verify(buffer, "engine-a", LAYOUT, local_tp, rank, REMOTE_BLOCKS)
        assert moved == buffer.numel() * buffer.element_size()
        assert sum(op.nbytes for op in ops) == moved


def test_a_larger_decode_tp_reads_one_descriptor_per_block_and_region_at_its_head_offset() -> None:
    caches = prefill_caches("e", 2)
    buffer = LAYOUT.allocate(4, len(REMOTE_BLOCKS))
    (op,) = plan_for(caches, 4, 3, buffer)
    assert op.remote_rank == 1
    assert len(op.remote) == LAYOUT.num_regions * len(REMOTE_BLOCKS)
    remote = kv_spec(caches[1], 2)
    head_len = LAYOUT.head_len
    # decode rank 3 holds global head 3 = the second of prefill rank 1's two heads.
    assert op.remote[0] == (remote.base_addrs[0] + 4 * remote.block_len + head_len, head_len, 0)


def test_a_smaller_decode_tp_places_each_prefill_ranks_block_side_by_side() -> None:
    caches = prefill_caches("e", 4)
    buffer = LAYOUT.allocate(2, len(REMOTE_BLOCKS))
    ops = plan_for(caches, 2, 1, buffer)
    assert [op.remote_rank for op in ops] == [2, 3]
    local = kv_spec(buffer, 2)
    assert ops[1].local[0] == (local.base_addrs[0] + LAYOUT.head_len, LAYOUT.head_len, 0)


def test_verification_catches_another_engines_bytes() -> None:
    caches = prefill_caches("engine-old", 1)
    buffer = LAYOUT.allocate(1, len(REMOTE_BLOCKS))
    execute(plan_for(caches, 1, 0, buffer))
    with pytest.raises(ValueError, match="differ"):
        verify(buffer, "engine-new", LAYOUT, 1, 0, REMOTE_BLOCKS)


def test_verification_catches_the_wrong_blocks_and_the_wrong_heads() -> None:
    caches = prefill_caches("e", 2)
    buffer = LAYOUT.allocate(2, len(REMOTE_BLOCKS))
    execute(plan_for(caches, 2, 0, buffer))
    verify(buffer, "e", LAYOUT, 2, 0, REMOTE_BLOCKS)
    with pytest.raises(ValueError, match="remote block 3"):
        verify(buffer, "e", LAYOUT, 2, 0, [3, 2, 0])
    with pytest.raises(ValueError, match="global head 2"):
        verify(buffer, "e", LAYOUT, 2, 1, REMOTE_BLOCKS)


def test_content_differs_for_every_engine_region_block_and_head() -> None:
    rows = {}
    for engine in ("e1", "e2"):
        content = pattern(engine, LAYOUT, list(range(LAYOUT.num_blocks)), 0, LAYOUT.num_heads)
        for r, b, h in itertools.product(
            range(LAYOUT.num_regions), range(LAYOUT.num_blocks), range(LAYOUT.num_heads)
        ):
            rows[(engine, r, b, h)] = content[r, b, h].flatten().tolist()
    assert len({tuple(v) for v in rows.values()}) == len(rows)
    assert engine_seed("e1") == engine_seed("e1") != engine_seed("e2")


def test_the_plan_refuses_targets_other_than_the_conventions_ranks() -> None:
    caches = prefill_caches("e", 2)
    buffer = LAYOUT.allocate(1, len(REMOTE_BLOCKS))
    with pytest.raises(ValueError, match="expected ranks"):
        plan_reads(
            LAYOUT,
            local_tp=1,
            local_rank=0,
            local=kv_spec(buffer, 4),
            remote_tp=2,
            tp_ratio=-2,
            targets={0: kv_spec(caches[0], 2)},
            local_block_ids=[0, 1, 2],
            remote_block_ids=REMOTE_BLOCKS,
        )


def test_the_plan_refuses_a_remote_whose_kv_layout_differs() -> None:
    other = KvLayout(num_layers=2, num_blocks=5, block_size=8, num_heads=4, head_size=8)
    remote = other.allocate(1, 5)
    buffer = LAYOUT.allocate(1, len(REMOTE_BLOCKS))
    with pytest.raises(ValueError, match="KV layouts differ"):
        plan_reads(
            LAYOUT,
            local_tp=1,
            local_rank=0,
            local=kv_spec(buffer, 4),
            remote_tp=1,
            tp_ratio=1,
            targets={0: kv_spec(remote, 4)},
            local_block_ids=[0, 1, 2],
            remote_block_ids=REMOTE_BLOCKS,
        )


def test_heads_that_do_not_split_over_the_tp_size_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        LAYOUT.local_heads(3)


def test_compat_describes_what_prefill_and_decode_must_share() -> None:
    compat = LAYOUT.compat("m")
    assert compat["block_size"] == 4
    assert compat["num_kv_heads"] == 4
    assert compat["kv_layout"] == "HND"
