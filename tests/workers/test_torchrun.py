"""workers.torchrun: torch's launcher as a container's PID 1, for real (torchrun, one rank).

Stopped with SIGTERM (`docker compose stop`), torchrun stops its ranks and then exits 1 with a
`SignalException` traceback; through workers.torchrun the node exits 0 with one line. A rank
that fails still fails the node, as with torchrun itself.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.workers, pytest.mark.timeout(120)]

RANK = """
import signal, sys, time
def stop(*_):
    print("rank stopping", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("rank serving", flush=True)
if sys.argv[1] == "fail":
    sys.exit(3)
time.sleep(120)
"""


def launch(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.torchrun",
            "--standalone",
            "--nproc-per-node=1",
            str(script),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_stopped_node_exits_0_with_one_line_after_its_ranks(tmp_path: Path) -> None:
    node = launch(tmp_path, "serve")
    assert node.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while "rank serving" not in "".join(seen) and time.monotonic() < deadline:
        seen.append(node.stdout.readline())
    node.send_signal(signal.SIGTERM)
    out, _ = node.communicate(timeout=60)
    output = "".join(seen) + out
    assert node.returncode == 0, output
    assert "rank stopping" in output  # the rank got the stop first
    assert output.count("torchrun stopped by SIGTERM") == 1, output
    assert "Traceback" not in output, output
    assert "death signal" not in output, output  # torchrun's own warnings, said by the line


def test_a_failing_rank_still_fails_the_node(tmp_path: Path) -> None:
    node = launch(tmp_path, "fail")
    out, _ = node.communicate(timeout=90)
    assert node.returncode == 1, out
    assert re.search(r"exitcode\s*:\s*3\b", out), out  # torchrun's error summary
    assert "stopped by" not in out
