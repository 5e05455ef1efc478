"""What a decode takes from a prefill's published handshake payload is bounded.

vLLM's worker sizes its remote descriptor lists by the payload's numbers (``num_blocks``,
``region_num_blocks``, the regions in ``kv_caches_base_addr``, the block-size ratio) and
``np.arange``-s over them: a hostile ``num_blocks`` of 2**40 runs the decode out of memory.
So before the plugin hands a payload to vLLM it reads those numbers (``NixlHandshakePayload``
-> ``agent_metadata_bytes`` -> ``NixlAgentMetadata``, msgpack maps as msgspec writes them)
and checks them against the rank's KV description as the registry holds it (which the
registry bounds: ``app/core/schemas.py``, the same limits, docs/api.md "kv") and against the same
limits on their own. A payload without ``agent_metadata_bytes`` sizes nothing here: vLLM's
decoder refuses it before any allocation.
"""

from __future__ import annotations

from typing import Any

import msgpack

from registry_client.models import KvSpec

# The registry's limits on a KV description (app/core/schemas.py; a unit test keeps them equal).
MAX_KV_REGIONS = 4096
MAX_NUM_BLOCKS = 2**24
MAX_BLOCK_LEN = 2**32
MAX_KV_DESCRIPTORS = 2**27
_REGION_LISTS = (
    "block_strides",
    "region_group_ids",
    "region_names",
    "region_mem_types",
    "region_members",
)


class PayloadOutOfBounds(ValueError):
    """A published payload whose numbers a decode must not size anything by."""


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PayloadOutOfBounds(f"{name} {value!r} is not an integer in {low}..{high}")
    return value


def _ints(value: Any, name: str, low: int, high: int, most: int) -> list[int]:
    if not isinstance(value, list) or len(value) > most:
        shown = len(value) if isinstance(value, list) else type(value).__name__
        raise PayloadOutOfBounds(f"{name} is not a list of at most {most} items ({shown})")
    return [_int(v, f"{name}[{i}]", low, high) for i, v in enumerate(value)]


def _unpack(data: Any, what: str) -> Any:
    if not isinstance(data, bytes | bytearray):
        raise PayloadOutOfBounds(f"{what} is not bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # any malformed msgpack (ExtraData, FormatError, ...), said
        raise PayloadOutOfBounds(f"{what} is not msgpack ({exc})") from None


def check_payload(payload: bytes, kv: KvSpec, local_block_size: int | None = None) -> None:
    """Raise `PayloadOutOfBounds` unless ``payload``'s sizes agree with ``kv`` (the rank's
    registered description) and stay within the limits. ``local_block_size``: this decode's
    block size (its compat's), which with the payload's gives vLLM's block-size ratio."""
    outer = _unpack(payload, "the payload")
    if not isinstance(outer, dict) or "agent_metadata_bytes" not in outer:
        return
    meta = _unpack(outer["agent_metadata_bytes"], "agent_metadata_bytes")
    if not isinstance(meta, dict):
        raise PayloadOutOfBounds("agent_metadata_bytes is not a map (NixlAgentMetadata)")
    num_blocks = _int(meta.get("num_blocks"), "num_blocks", 1, MAX_NUM_BLOCKS)
    if num_blocks != kv.num_blocks:
        raise PayloadOutOfBounds(
            f"num_blocks {num_blocks} differs from the registered kv.num_blocks {kv.num_blocks}"
        )
    addrs = _ints(
        meta.get("kv_caches_base_addr"), "kv_caches_base_addr", 0, 2**64 - 1, MAX_KV_REGIONS
    )
    if addrs != list(kv.base_addrs):
        raise PayloadOutOfBounds(
            f"kv_caches_base_addr ({len(addrs)} regions) differs from the registered "
            f"kv.base_addrs ({len(kv.base_addrs)} regions)"
        )
    regions = len(addrs)
    lens = _ints(meta.get("block_lens"), "block_lens", 1, MAX_BLOCK_LEN, MAX_KV_REGIONS)
    if len(lens) != regions or (lens and lens[0] != kv.block_len):
        raise PayloadOutOfBounds(
            f"block_lens ({len(lens)} items, first {lens[:1]}) does not match the registered "
            f"{regions} regions of kv.block_len {kv.block_len}"
        )
    for name in _REGION_LISTS:
        value = meta.get(name)
        if value is not None and (not isinstance(value, list) or len(value) > regions):
            raise PayloadOutOfBounds(f"{name} is not a list of at most {regions} items")
    per_region = meta.get("region_num_blocks")
    counts = [num_blocks] * max(1, regions)
    if per_region is not None:
        counts = _ints(per_region, "region_num_blocks", 0, MAX_NUM_BLOCKS, regions)
        if len(counts) != regions:
            raise PayloadOutOfBounds(
                f"region_num_blocks has {len(counts)} items for {regions} regions"
            )
    physical = meta.get("physical_blocks_per_logical_kv_block", 1)
    _int(physical, "physical_blocks_per_logical_kv_block", 1, MAX_NUM_BLOCKS)
    block_size = _int(meta.get("block_size", 1), "block_size", 1, MAX_NUM_BLOCKS)
    ratio = 1
    if local_block_size is not None and local_block_size > block_size:
        ratio = -(-local_block_size // block_size)
    descriptors = sum(counts) * ratio
    if descriptors > MAX_KV_DESCRIPTORS:
        raise PayloadOutOfBounds(
            f"{descriptors} block descriptors (region_num_blocks summed, times the block-size "
            f"ratio {ratio}) exceed {MAX_KV_DESCRIPTORS}"
        )
