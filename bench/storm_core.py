"""The launch storm's shape, shared by the registry storms and the baselines: TP size, blob
sizes, heartbeat interval, the groups, and the per-operation recorder."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

TP = 8
HEARTBEAT_S = 10.0
TTL_S = 30
BLOB_MIN, BLOB_MAX = 4 * 1024, 256 * 1024
# The issue's storm: every agent's metadata 4 KiB (NIXL's UCX metadata for one DRAM or GPU
# region is a few KiB). ``None``: the heavier mix of 4 KiB to 256 KiB, log-uniform.
ISSUE_BLOB = 4 * 1024
STORM_TIMEOUT_S = 300.0
PACED_S = 8.0
COMPAT: dict[str, Any] = {
    "model": "llama-3-8b",
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 128,
    "num_layers": 32,
    "kv_layout": "HND",
    "attn_backend": "FLASH_ATTN",
    "nixl_version": "1.5.1",
}
# Operations whose latency the p99 target covers (wait_ready is held on purpose).
TARGET_OPS = ("open", "get_engine", "register", "heartbeat", "handshake")


def blob_sizes(n: int, seed: int = 6) -> list[int]:
    rng = random.Random(seed)
    lo, hi = math.log(BLOB_MIN), math.log(BLOB_MAX)
    return [int(math.exp(rng.uniform(lo, hi))) for _ in range(n)]


def make_blobs(n: int, size: int | None = None) -> list[bytes]:
    """Distinct pseudo-random blobs (a rank-specific header over shared random bytes), all of
    ``size`` bytes, or of the log-uniform mix when ``size`` is None."""
    pool = random.Random(7).randbytes(BLOB_MAX)
    sizes = [size] * n if size else blob_sizes(n)
    return [f"rank{i:06d}".encode() + pool[: s - 10] for i, s in enumerate(sizes)]


@dataclass
class Recorder:
    ops: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requests: int = 0

    async def timed(self, op: str, call: Callable[[], Awaitable[Any]]) -> Any:
        t = time.perf_counter()
        result = await call()
        self.ops[op].append(time.perf_counter() - t)
        self.requests += 1
        return result


def _groups(ranks: int) -> list[tuple[str, str, int]]:
    """(group_id, role, pair index) for ranks // TP groups, half prefill, half decode."""
    pairs = ranks // TP // 2
    return [(f"prefill-{i}", "prefill", i) for i in range(pairs)] + [
        (f"decode-{i}", "decode", i) for i in range(pairs)
    ]


async def every_heartbeat(
    stop: asyncio.Event, phase: float, beat: Callable[[], Awaitable[object]]
) -> None:
    """Call ``beat`` first after ``phase`` seconds, then every ``HEARTBEAT_S``, until ``stop``
    is set (bounded by the storm's own deadline)."""
    delay = phase
    for _ in range(int(STORM_TIMEOUT_S / HEARTBEAT_S) + 1):
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return
        except TimeoutError:
            pass
        await beat()
        delay = HEARTBEAT_S


def storm_row(storm: Any, done: float) -> dict[str, Any]:
    """The figures every storm reports: ``storm`` has ``ranks``, ``groups``, ``ready_at``,
    ``handshake_done`` and ``rec`` (a Recorder); ``done`` is its whole duration."""
    from bench.common import summary_ms

    ready = max(storm.ready_at.values())
    rec: Recorder = storm.rec
    return {
        "ranks": storm.ranks,
        "groups": len(storm.groups),
        "ready_s": round(ready, 3),
        "ranks_per_s": round(storm.ranks / ready, 1),
        "handshakes_done_s": round(max(storm.handshake_done), 3),
        "total_s": round(done, 3),
        "requests": rec.requests,
        "requests_per_s": round(rec.requests / done, 1),
        "ops": {op: summary_ms(v) for op, v in rec.ops.items()},
        "errors": dict(rec.errors),
    }


def worst_p99_ms(rec: Recorder) -> float:
    """The worst p99 among the operations the per-operation target covers."""
    from bench.common import summary_ms

    return max(summary_ms(rec.ops[op])["p99_ms"] for op in TARGET_OPS if rec.ops[op])
