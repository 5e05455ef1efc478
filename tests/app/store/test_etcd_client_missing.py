"""An install without the etcd client (``make run``'s: the service alone) asked to serve an
etcd store stops before serving with one line that says how to install the client from the
checkout (the package is not on an index), exit 2, no traceback. The missing library is
made missing in the child alone (``sys.modules["aetcd"] = None``: its import fails as an
absent package's does)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.server import ROOT

pytestmark = pytest.mark.unit

CHILD = """
import sys
sys.modules["aetcd"] = None
from app.cli import main
sys.exit(main(["serve", "--port", "0", "--store", "etcd://127.0.0.1:1/registry"]))
"""


def test_serve_without_the_etcd_client_says_how_to_install_it_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "aetcd not installed" in lines[0]
    assert "from the checkout: .venv/bin/pip install -e '.[etcd]'" in lines[0]
    assert "pip install 'engine-registry[etcd]'" not in done.stderr
