"""KV cache layout, deterministic content, and the heterogeneous-TP read plan.

Layout (vLLM's HND, one region per layer and K|V): a rank's cache is one tensor
`[num_layers * 2, num_blocks, local_heads, block_size, head_size]`. Region `i` starts at
`tensor[i].data_ptr()`; block `b` of it at `+ b * block_len`; inside a block the heads are
outermost, so any run of consecutive heads of one block is one contiguous descriptor. That is
what lets a decode rank read a head *slice* of a prefill block (decode TP > prefill TP), or
place whole prefill blocks side by side in its own block (decode TP < prefill TP).

Content: element `t` of (region, block, global head) holds the 16-bit pattern
`mix(engine, region, block, head) + t`, so a decode rank that got a wrong head, block, region
or engine sees different bytes. The dtype is float16 on the wire; the pattern is written and
compared through an int16 view (bit-exact, NaN patterns included).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from registry_client.models import Compat, KvSpec

_M31 = (1 << 31) - 1


@dataclass(frozen=True)
class KvLayout:
    """The model-wide shape of the KV cache (what `compat` describes)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: str = "float16"

    @property
    def itemsize(self) -> int:
        return int(torch.empty((), dtype=self.torch_dtype).element_size())

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or dtype.itemsize != 2:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (a 16-bit type is needed)")
        return dtype

    @property
    def num_regions(self) -> int:
        return self.num_layers * 2

    @property
    def head_len(self) -> int:
        """Bytes of one head of one block."""
        return self.block_size * self.head_size * self.itemsize

    def local_heads(self, tp_size: int) -> int:
        if self.num_heads % tp_size:
            raise ValueError(f"{self.num_heads} KV heads do not split over TP size {tp_size}")
        return self.num_heads // tp_size

    def block_len(self, tp_size: int) -> int:
        return self.local_heads(tp_size) * self.head_len

    def compat(self, model: str) -> Compat:
        return {
            "model": model,
            "dtype": self.dtype,
            "kv_cache_dtype": self.dtype,
            "block_size": self.block_size,
            "num_kv_heads": self.num_heads,
            "head_size": self.head_size,
            "num_layers": self.num_layers,
            "kv_layout": "HND",
        }

    def allocate(self, tp_size: int, num_blocks: int, device: str = "cpu") -> torch.Tensor:
        shape = (
            self.num_regions,
            num_blocks,
            self.local_heads(tp_size),
            self.block_size,
            self.head_size,
        )
        return torch.zeros(shape, dtype=self.torch_dtype, device=device)


def kv_spec(cache: torch.Tensor, heads: int) -> KvSpec:
    """What a rank publishes about its cache tensor (see `KvLayout.allocate`)."""
    return KvSpec(
        mem_type="DRAM" if cache.device.type == "cpu" else "VRAM",
        device_id=max(cache.get_device(), 0),
        base_addrs=[int(cache[i].data_ptr()) for i in range(cache.shape[0])],
        num_blocks=int(cache.shape[1]),
        block_len=int(cache[0, 0].numel() * cache.element_size()),
        num_heads=heads,
    )


def engine_seed(engine_id: str) -> int:
    return int.from_bytes(hashlib.sha256(engine_id.encode()).digest()[:4], "big") & _M31


def _region_pattern(
    seed: int, layout: KvLayout, region: int, blocks: torch.Tensor, heads: torch.Tensor
) -> torch.Tensor:
    """int16 content of one region: `[len(blocks), len(heads), block_size, head_size]`.

    The per-row mix is computed in int64 (tiny), the per-element sum in int32 (4 bytes per
    element, one region at a time), so filling or checking gigabytes stays cheap in memory.
    """
    base = (seed * 1_000_003 + region * 7_919) % _M31
    mix = (blocks.view(-1, 1) * 104_729 + base) % _M31
    mix = (mix + heads.view(1, -1) * 15_485_863) % _M31
    mix = ((mix * 2_654_435_761) % _M31) & 0xFFFF
    t = torch.arange(layout.block_size * layout.head_size, dtype=torch.int32, device=mix.device)
    values = (mix.to(torch.int32).unsqueeze(-1) + t) & 0xFFFF
    values = values - ((values & 0x8000) << 1)  # to the signed 16-bit range, exactly
    return values.to(torch.int16).view(len(blocks), len(heads), layout.block_size, layout.head_size)


def _indices(
    block_ids: list[int], head_start: int, head_count: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    heads = torch.arange(head_start, head_start + head_count, dtype=torch.int64, device=device)
    return blocks, heads


def pattern(
    engine_id: str,
    layout: KvLayout,
    block_ids: list[int],
    head_start: int,
    head_count: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int16 content `[regions, len(block_ids), head_count, block_size, head_size]`."""
    seed = engine_seed(engine_id)
    blocks, heads = _indices(block_ids, head_start, head_count, device)
    return torch.stack(
        [_region_pattern(seed, layout, r, blocks, heads) for r in range(layout.num_regions)]
    )


def fill(cache: torch.Tensor, engine_id: str, layout: KvLayout, tp_size: int, rank: int) -> None:
    """Write this prefill rank's share: its heads of every block, for `engine_id`."""
    heads_per_rank = layout.local_heads(tp_size)
    seed = engine_seed(engine_id)
    blocks, heads = _indices(
        list(range(cache.shape[1])), rank * heads_per_rank, heads_per_rank, cache.device
    )
    out = cache.view(torch.int16)
    for region in range(layout.num_regions):
        out[region].copy_(_region_pattern(seed, layout, region, blocks, heads))


def verify(
    buffer: torch.Tensor,
    engine_id: str,
    layout: KvLayout,
    tp_size: int,
    rank: int,
    remote_block_ids: list[int],
) -> int:
    """Compare a decode rank's buffer (block i = remote block `remote_block_ids[i]`) with what
    the prefill engine wrote for this rank's heads; returns the bytes checked."""
    heads_per_rank = layout.local_heads(tp_size)
    seed = engine_seed(engine_id)
    blocks, heads = _indices(remote_block_ids, rank * heads_per_rank, heads_per_rank, buffer.device)
    got = buffer[:, : len(remote_block_ids)].view(torch.int16)
    for region in range(layout.num_regions):
        want = _region_pattern(seed, layout, region, blocks, heads)
        if not torch.equal(got[region], want):
            bad = (got[region] != want).nonzero()
            block, head = (int(x) for x in bad[0][:2])
            raise ValueError(
                f"{bad.shape[0]} of {want.numel()} elements differ in region {region}; first "
                f"at remote block {remote_block_ids[block]}, global head "
                f"{rank * heads_per_rank + head}"
            )
    return int(got.numel() * got.element_size())


@dataclass(frozen=True)
class ReadOp:
    """The descriptors for one READ from one remote rank: `(addr, len, device_id)` each."""

    remote_rank: int
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length, _ in self.local)


def plan_reads(
    layout: KvLayout,
    *,
    local_tp: int,
    local_rank: int,
    local: KvSpec,
    remote_tp: int,
    tp_ratio: int,
    targets: dict[int, KvSpec],
    local_block_ids: list[int],
    remote_block_ids: list[int],
) -> list[ReadOp]:
    """Descriptors for reading `remote_block_ids` into `local_block_ids` (vLLM's convention).

    `tp_ratio > 0` (local TP >= remote TP): one target, rank `local_rank // tp_ratio`; read the
    slice of heads `(local_rank % tp_ratio) * local_heads ...` of each of its blocks.
    `tp_ratio < 0`: `|tp_ratio|` targets; target k's whole block lands at head offset
    `k * remote_heads` of the local block.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError("local and remote block lists differ in length")
    local_heads = layout.local_heads(local_tp)
    remote_heads = layout.local_heads(remote_tp)
    if local.block_len != local_heads * layout.head_len:
        raise ValueError("local block_len does not match the layout")
    if tp_ratio > 0:
        expected = [local_rank // tp_ratio]
    else:
        expected = [local_rank * -tp_ratio + k for k in range(-tp_ratio)]
    if sorted(targets) != expected:
        raise ValueError(f"handshake targets {sorted(targets)} != expected ranks {expected}")
    ops: list[ReadOp] = []
    for k, remote_rank in enumerate(expected):
        spec = targets[remote_rank]
        if spec.block_len != remote_heads * layout.head_len:
            raise ValueError(
                f"remote rank {remote_rank} block_len {spec.block_len} != "
                f"{remote_heads} heads x {layout.head_len} bytes: KV layouts differ"
            )
        if len(spec.base_addrs) != len(local.base_addrs):
            raise ValueError(f"remote rank {remote_rank} has {len(spec.base_addrs)} regions")
        if max(remote_block_ids, default=-1) >= spec.num_blocks:
            raise ValueError(f"remote rank {remote_rank} has only {spec.num_blocks} blocks")
        if tp_ratio > 0:
            remote_off = (local_rank % tp_ratio) * local_heads * layout.head_len
            local_off, length = 0, local.block_len
        else:
            remote_off, local_off, length = 0, k * spec.block_len, spec.block_len
        local_descs: list[tuple[int, int, int]] = []
        remote_descs: list[tuple[int, int, int]] = []
        for region in range(len(local.base_addrs)):
            for lb, rb in zip(local_block_ids, remote_block_ids, strict=True):
                local_descs.append(
                    (
                        local.base_addrs[region] + lb * local.block_len + local_off,
                        length,
                        local.device_id,
                    )
                )
                remote_descs.append(
                    (
                        spec.base_addrs[region] + rb * spec.block_len + remote_off,
                        length,
                        spec.device_id,
                    )
                )
        ops.append(ReadOp(remote_rank, local_descs, remote_descs))
    return ops
