"""A green ``make test`` means every tier ran: under ENGINE_REGISTRY_REQUIRE_ALL=1 (or CI) a
skip for a missing part is a failure naming it (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_needs_a_binary() -> None:
    pytest.skip("no frobnicator binary")
"""


def run(tmp_path: Path, require_all: bool) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_skipping.py"
    test.write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "ENGINE_REGISTRY_REQUIRE_ALL"}}
    if require_all:
        env["ENGINE_REGISTRY_REQUIRE_ALL"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(test),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_skip_for_a_missing_part_fails_when_every_tier_must_run(tmp_path: Path) -> None:
    strict = run(tmp_path, require_all=True)
    assert strict.returncode == 1, strict.stdout
    assert "every tier must run" in strict.stdout
    assert "no frobnicator binary" in strict.stdout


def test_the_same_skip_is_a_skip_on_a_developers_machine(tmp_path: Path) -> None:
    lenient = run(tmp_path, require_all=False)
    assert lenient.returncode == 0, lenient.stdout
    assert "1 skipped" in lenient.stdout


def test_the_service_imports_no_torch_nixl_workers_or_router_sync_code() -> None:
    # It shares the torch-free client package's compat rule, back-off policy and TLS files
    # (registry_client), never the worker runtime (workers), nor router-sync's ZMQ and msgpack.
    probe = (
        "import sys, app.main, app.cli, app.server.serve, app.store.sqlite.store, "
        "app.store.etcd.store;"
        "banned = {'torch', 'nixl', 'workers', 'zmq', 'msgpack'};"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned"
        " or m.startswith('registry_client.router_sync'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
