"""Transfer: NIXL READ bandwidth over DRAM between two processes, against a memory copy.

The target process (``bench.nixl_peer target``) registers ``TOTAL`` bytes of DRAM; this
process registers as much and, for each block size, READs the whole region as blocks of that
size (one transfer of ``TOTAL / size`` descriptors, repeated; the handle prepared once, the
completion busy-polled). The baseline copies the same bytes, laid out as the same blocks, with
``torch.Tensor.copy_`` in one process (a memcpy), best of the same number of repetitions. The
first READ is checked byte for byte against the target's pattern.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import numpy as np

from bench.common import peer, say

KIB, MIB = 1024, 1024 * 1024
SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)


def _memcpy_gbps(total: int, block: int, reps: int) -> float:
    import torch

    src = torch.ones(total, dtype=torch.uint8).view(total // block, block)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first, as the READ's were
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return total / best / 1e9


def _read_gbps(
    agent: Any, remote: dict[str, Any], local_addr: int, total: int, block: int, reps: int
) -> tuple[float, float]:
    count = total // block
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(block)

    def descs(base: int) -> Any:
        rows = np.stack(
            [
                offsets + np.uint64(base),
                np.full(count, block, np.uint64),
                np.zeros(count, np.uint64),
            ],
            axis=1,
        )
        return agent.get_xfer_descs(rows, "DRAM")

    handle = agent.initialize_xfer("READ", descs(local_addr), descs(remote["addr"]), remote["name"])
    times: list[float] = []
    deadline = time.monotonic() + 30
    try:
        for _ in range(reps):
            t = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"READ of {block}-byte blocks not done within 30 s")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"READ of {block}-byte blocks ended {state}")
            times.append(time.perf_counter() - t)
    finally:
        agent.release_xfer_handle(handle)
    return total / min(times) / 1e9, total / float(np.median(times)) / 1e9


def run(quick: bool = False) -> dict[str, Any]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    total = 64 * MIB
    reps = 5 if quick else 20
    sizes = SIZES
    rows: list[dict[str, Any]] = []
    say(f"  target: {total // MIB} MiB of registered DRAM in a peer process")
    with peer(["target", str(total)]) as remote:
        agent = nixl_agent("bench-reader", nixl_agent_config(backends=["UCX"]))
        local = torch.zeros(total, dtype=torch.uint8)
        agent.register_memory(local)
        name = agent.add_remote_agent(base64.b64decode(remote["metadata"]))
        remote["name"] = name.decode() if isinstance(name, bytes) else name
        _read_gbps(agent, remote, local.data_ptr(), total, MIB, 1)
        expected = (torch.arange(total, dtype=torch.int64) % 251).to(torch.uint8)
        if not torch.equal(local, expected):
            raise RuntimeError("NIXL READ returned the wrong bytes")
        for block in sizes:
            if block > total:
                continue
            best, median = _read_gbps(agent, remote, local.data_ptr(), total, block, reps)
            copy = _memcpy_gbps(total, block, reps)
            row = {
                "block_bytes": block,
                "blocks": total // block,
                "read_gbps_best": round(best, 2),
                "read_gbps_median": round(median, 2),
                "memcpy_gbps": round(copy, 2),
                "ratio": round(best / copy, 3),
            }
            say(
                f"  {block // KIB:>6} KiB blocks: READ {row['read_gbps_best']} GB/s, "
                f"memcpy {row['memcpy_gbps']} GB/s, ratio {row['ratio']}"
            )
            rows.append(row)
        agent.remove_remote_agent(remote["name"])
    return {
        "bytes_per_transfer": total,
        "repetitions": reps,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "rows": rows,
    }
