"""Real `torchrun` launches of the worker entrypoints, for end-to-end tests.

Each `Launch` is one `torchrun --nnodes N --node-rank K` invocation ("a node"), in its own
process session so that stopping it reaches its workers; every wait has a deadline, and
`launched()` stops whatever is still running when a test ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workers.tools.procs import Proc
from workers.tools.procs import free_port as free_port

ROOT = Path(__file__).resolve().parents[2]

# A tiny model: every TP size the tests use (1, 2, 4) divides 4 heads; one block is 512 B.
SMALL_LAYOUT = [
    "--num-layers",
    "1",
    "--num-blocks",
    "6",
    "--block-size",
    "4",
    "--num-heads",
    "4",
    "--head-size",
    "16",
]


class Launch(Proc):
    """One torchrun invocation, logging to a file (its own, emptied)."""

    def __init__(
        self, name: str, cmd: list[str], log_path: Path, extra_env: Mapping[str, str] | None = None
    ) -> None:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            **(extra_env or {}),
        }
        log_path.write_bytes(b"")
        super().__init__(name, cmd, env, log_path)

    def wait(self, timeout_s: float) -> int:
        """The exit status; a launch still running after `timeout_s` is stopped and fails."""
        code = super().wait(timeout_s)
        if code is None:
            self.stop()
            raise AssertionError(f"{self.name} still running after {timeout_s}s:\n{self.tail()}")
        return code

    def log(self) -> str:
        return self.text()

    def tail(self, lines: int = 40) -> str:
        kept = [line for line in self.log().splitlines() if "NIXL INFO" not in line]
        return "\n".join(kept[-lines:])


def start_group(
    role: str,
    tmp_path: Path,
    *,
    group_id: str | Sequence[str],
    registry: str | Sequence[str],
    tp: int,
    nodes: int = 1,
    args: Sequence[str] = (),
    env: Sequence[Mapping[str, str]] = (),
) -> list[Launch]:
    """Start `role` (prefill|decode) as `nodes` torchrun invocations forming one TP group.

    `group_id` and `registry` may be given per node, to test what happens when they differ;
    `env`, one mapping per node, adds to a node's environment.
    """
    port = free_port()
    report_dir = tmp_path / "reports"
    report_dir.mkdir(exist_ok=True)
    launches = []
    for node in range(nodes):
        gid = group_id if isinstance(group_id, str) else group_id[node]
        url = registry if isinstance(registry, str) else registry[node]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--nproc-per-node",
            str(tp // nodes),
            "-m",
            f"workers.{role}",
            "--registry",
            url,
            "--group-id",
            gid,
            "--report-dir",
            str(report_dir),
            "--collective-timeout-s",
            "60",
            "--timeout-s",
            "15",
            *SMALL_LAYOUT,
            *args,
        ]
        name = f"{role}-{gid}-node{node}"
        log_path = tmp_path / f"{name}-{time.monotonic_ns()}.log"
        launches.append(Launch(name, cmd, log_path, env[node] if env else None))
    return launches


@contextmanager
def launched(*groups: list[Launch]) -> Iterator[list[Launch]]:
    """Stop every launch still running when the block ends."""
    everything = [launch for group in groups for launch in group]
    try:
        yield everything
    finally:
        for launch in everything:
            launch.stop()


def wait_all(launches: Sequence[Launch], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    return [launch.wait(max(0.1, deadline - time.monotonic())) for launch in launches]


def reports(tmp_path: Path, role: str, group_id: str) -> list[dict[str, Any]]:
    found = [
        json.loads(p.read_text())
        for p in (tmp_path / "reports").glob(f"{role}-{group_id}-rank*.json")
    ]
    return sorted(found, key=lambda r: int(r["rank"]))


def wait_for_report(
    tmp_path: Path, role: str, group_id: str, predicate: Any, timeout_s: float
) -> list[dict[str, Any]]:
    """Poll the rank reports until `predicate(reports)` holds, or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = reports(tmp_path, role, group_id)
        if found and predicate(found):
            return found
        time.sleep(0.1)
    raise AssertionError(
        f"{role} {group_id}: reports never matched: {reports(tmp_path, role, group_id)}"
    )


def logs(launches: Sequence[Launch]) -> str:
    return "\n".join(f"--- {launch.name} ---\n{launch.tail()}" for launch in launches)
