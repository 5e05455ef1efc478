"""`workers.tools.procs.Proc` with an echo: every line of a real child's output reaches the log
file and the callback, stdout and stderr alike; `stop` ends a child that would run on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from workers.tools.procs import Proc

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CHILD = """
import sys
for i in range(3):
    print(f"line {i}", flush=True)
print("err", file=sys.stderr)
"""


def test_each_line_goes_to_the_log_and_to_the_echo(tmp_path: Path) -> None:
    seen: list[str] = []
    proc = Proc(
        "child",
        [sys.executable, "-c", CHILD],
        os.environ,
        tmp_path / "child.log",
        cwd=tmp_path,
        echo=seen.append,
    )
    assert proc.wait(30) == 0
    proc.drain()
    assert seen == ["line 0", "line 1", "line 2", "err"]
    assert proc.text().splitlines() == seen


def test_stop_ends_a_child_that_runs_on_and_its_output_is_kept(tmp_path: Path) -> None:
    seen: list[str] = []
    forever = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(1)\n"
    proc = Proc(
        "forever",
        [sys.executable, "-c", forever],
        os.environ,
        tmp_path / "f.log",
        cwd=tmp_path,
        echo=seen.append,
    )
    assert proc.wait(1.0) is None  # still running
    proc.stop(grace_s=5.0)
    assert not proc.alive()
    assert seen == ["up"]
    assert proc.text() == "up\n"
