"""``python -m bench.nixl_progress``: what NIXL's busy-polling progress thread costs on a host
with more busy threads than cores, against the event-driven one the project sets
(workers/nixl_progress.py), in one run, interleaved.

Per mode (``ENGINE_REGISTRY_NIXL_PROGRESS_US`` 0, NIXL's own, and 1000), per round: a target
process holds 64 KiB of registered DRAM (``bench.nixl_peer target``), this process adds it and
READs it once (the first READ includes UCX's connection set-up) and 20 times more, while
``cores + 1`` processes spin (a stand-in for a host whose cores are all busy, as vLLM's
workers keep them). Also the target's CPU over 3 s with nothing to transfer. Written to
``bench/results/nixl_progress.json``; each figure beside the other mode's, as a ratio.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, peer, say
from workers import nixl_progress

SIZE = 64 * 1024
WARM = 20


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read(agent: Any, remote: dict[str, Any], local: Any, name: str) -> float:
    descs = agent.get_xfer_descs([(local.data_ptr(), SIZE, 0)], "DRAM")
    rdescs = agent.get_xfer_descs([(remote["addr"], SIZE, 0)], "DRAM")
    t0 = time.perf_counter()
    handle = agent.initialize_xfer("READ", descs, rdescs, name, b"")
    try:
        state = agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - t0 > 60:
                raise TimeoutError("a 64 KiB READ not done within 60 s")
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"READ ended {state}")
        return time.perf_counter() - t0
    finally:
        agent.release_xfer_handle(handle)


def one_round(delay_us: int) -> dict[str, Any]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    os.environ[nixl_progress.ENV] = str(delay_us)
    nixl_progress.apply(delay_us)
    with peer(["target", str(SIZE)]) as remote, _spinning():
        t0 = _cpu_s(remote["pid"])
        time.sleep(3.0)
        idle_cpu = (_cpu_s(remote["pid"]) - t0) / 3.0
        agent = nixl_agent(
            f"progress-{delay_us}-{time.monotonic_ns()}", nixl_agent_config(backends=["UCX"])
        )
        local = torch.zeros(SIZE, dtype=torch.uint8)
        agent.register_memory(local)
        name = agent.add_remote_agent(base64.b64decode(remote["metadata"]))
        name = name.decode() if isinstance(name, bytes) else name
        first = _read(agent, remote, local, name)
        warm = [_read(agent, remote, local, name) for _ in range(WARM)]
        agent.remove_remote_agent(name)
    return {
        "first_s": first,
        "warm_median_s": statistics.median(warm),
        "warm_max_s": max(warm),
        "target_idle_cores": idle_cpu,
    }


@contextlib.contextmanager
def _spinning() -> Iterator[None]:
    """``cores + 1`` busy processes while the block runs (started once the peer is up: a peer
    importing torch beside them took minutes to say it was ready)."""
    cores = os.cpu_count() or 1
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]
    try:
        yield
    finally:
        for proc in spin:
            proc.kill()
            proc.wait()


def main() -> int:
    cores = os.cpu_count() or 1
    rows: dict[str, list[dict[str, Any]]] = {"0": [], "1000": []}
    for n in range(3):
        for delay in (0, 1000):
            row = one_round(delay)
            rows[str(delay)].append(row)
            say(
                f"  round {n + 1}, delay {delay} us: first READ {row['first_s']:.4f} s, warm "
                f"median {row['warm_median_s'] * 1e3:.2f} ms, max {row['warm_max_s'] * 1e3:.1f}"
                f" ms, idle target {row['target_idle_cores']:.2f} cores"
            )
    summary = {
        key: statistics.median(r[key] for r in rows["0"])
        / statistics.median(r[key] for r in rows["1000"])
        for key in ("first_s", "warm_median_s", "target_idle_cores")
    }
    say(f"  busy polling / event-driven (medians of 3): {summary}")
    out = {
        "machine": machine(),
        "spinning_processes": cores + 1,
        "bytes": SIZE,
        "rows": rows,
        "ratio_busy_to_event": summary,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "nixl_progress.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
