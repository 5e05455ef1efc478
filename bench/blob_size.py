"""``python -m bench.blob_size``: how large NIXL's agent metadata is, by registered regions.

One NIXL agent (UCX backend) per count registers that many separate DRAM buffers, as vLLM's
NIXL connector registers one region per KV-cache tensor (one a layer), and the bytes of
``get_agent_metadata()`` are fitted as ``a + b * regions`` (least squares). What the blob
holds: the agent's name, the backend's connection info (the UCX worker address) and, per
registered region, its descriptor and the backend's remote key. Beside each size, the bytes
the registry stores for it (``app/registry/blobs.py``: deflated at its level when that saves an
eighth). Prints one JSON object.

``samples`` gives real metadata blobs for the fleet benchmarks (``bench.fleet --blob nixl``):
one agent each, its own buffers, so no two are alike.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from app.registry.blobs import stored

COUNTS = (1, 2, 8, 32, 80, 160)


def metadata(name: str, regions: int, region_bytes: int = 1 << 16) -> bytes:
    """The agent metadata of a real NIXL agent (UCX) named ``name`` that registered
    ``regions`` separate DRAM buffers."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False))
    buffers = [ctypes.create_string_buffer(region_bytes) for _ in range(regions)]
    ranges = [(ctypes.addressof(b), region_bytes, 0, "") for b in buffers]
    agent.register_memory(agent.get_reg_descs(ranges, "DRAM"))
    return bytes(agent.get_agent_metadata())


def samples(regions: int, count: int = 16) -> list[bytes]:
    """``count`` real metadata blobs of ``regions`` regions, from as many agents."""
    return [metadata(f"fleet-sample-{i}-of-{count}", regions) for i in range(count)]


def measure(counts: tuple[int, ...] = COUNTS, region_bytes: int = 1 << 16) -> dict[str, Any]:
    sizes: dict[int, int] = {}
    kept: dict[int, int] = {}
    for n in counts:
        blob = metadata(f"blob-{n}", n, region_bytes)
        sizes[n] = len(blob)
        kept[n] = len(stored(blob, "deflate"))
    xs, ys = list(sizes), list(sizes.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) for x, y in zip(xs, ys, strict=True))
    return {
        "bytes_by_regions": sizes,
        "stored_bytes_by_regions": kept,
        "a_bytes": round(a, 1),
        "b_bytes_per_region": round(b, 2),
        "worst_residual_bytes": round(worst, 1),
        "memory": "DRAM",
        "backend": "UCX",
    }


def main() -> int:
    print(json.dumps(measure(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
