"""workers.tools.cpu_amx on this machine, in fresh processes (no vLLM needed).

On an AMX machine: a fresh process lacks the permission, `request()` gets it, a fork keeps
it and an exec loses it (why `workers.tools.vllm_serve` asks at import, in every spawned process).
Elsewhere: nothing is offered and `request()` changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.tools import cpu_amx

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import json, os, subprocess, sys
from dataclasses import asdict
from workers.tools import cpu_amx
before = cpu_amx.state().permitted
after = cpu_amx.request()
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, b"1" if cpu_amx.state().permitted else b"0")
    os._exit(0)
os.wait()
forked = os.read(r, 1) == b"1"
execed = subprocess.run(
    [sys.executable, "-c", "from workers.tools import cpu_amx; print(cpu_amx.state().permitted)"],
    capture_output=True, text=True, check=True,
).stdout.strip() == "True"
print(json.dumps({"before": before, "after": asdict(after), "fork": forked, "exec": execed}))
"""


def _run_child() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_the_state_agrees_with_proc_cpuinfo() -> None:
    state = cpu_amx.state()
    flags = Path("/proc/cpuinfo").read_text().split()
    assert state.amx_tile == ("amx_tile" in flags)
    assert state.cpu_model
    if not state.amx_tile:
        assert not state.kernel_offers


def test_request_gets_the_permission_where_offered_and_only_fork_keeps_it() -> None:
    offered = cpu_amx.state().kernel_offers
    got = _run_child()
    after = got["after"]
    assert isinstance(after, dict)
    assert got["before"] is False  # nothing in a fresh Python process asks for it
    assert after["permitted"] is offered, got
    assert after["detail"] == "", got
    assert got["fork"] is offered, got  # inherited on fork
    assert got["exec"] is False, got  # cleared on exec: each spawned process must ask


def test_the_cli_reports_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers.tools.cpu_amx"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    assert set(report) >= {"cpu_model", "amx_tile", "kernel_offers", "permitted"}
