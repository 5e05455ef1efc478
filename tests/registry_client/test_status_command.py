"""``engine-registry status`` given replicas (``--url A,B``, as ``probe`` and ``router-sync``
take them): the first that answers gives the table; none answering names each. The watch's
header before its first list says it is connecting, not ``revision None``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import format_groups
from harness.server import ROOT, RegistryProcess, free_port
from registry_client.status_view import Watch

pytestmark = [pytest.mark.api, pytest.mark.timeout(90)]


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", "status", "--timeout", "5", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_takes_a_comma_list_and_reads_the_first_replica_that_answers(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'r.db'}", log_path=tmp_path / "registry.log"
    ) as registry:
        done = status("--url", f"{dead}, {registry.url}/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no groups\n"), done.stdout
    other = f"http://127.0.0.1:{free_port()}"
    none = status("--url", f"{dead},{other}")
    assert none.returncode == 1, none.stderr
    assert "Traceback" not in none.stderr
    assert f"cannot reach {dead}" in none.stderr
    assert f"cannot reach {other}" in none.stderr


def test_the_watch_header_says_connecting_before_its_first_list() -> None:
    watch = Watch("http://127.0.0.1:1", {}, 1.0, 1.0, format_groups)
    head = watch.frame(0.0).split("\n")[0]
    assert "connecting" in head
    assert "None" not in head
    watch.revision = 7
    assert "watching (revision 7)" in watch.frame(0.0).split("\n")[0]
