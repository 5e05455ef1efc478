from __future__ import annotations

import subprocess
import sys

import pytest

from app.cli import format_groups

pytestmark = pytest.mark.unit


def test_status_table_shows_ready_ranks_and_missing_ranks() -> None:
    table = format_groups(
        [
            {
                "group_id": "prefill-0",
                "role": "prefill",
                "generation": 3,
                "engine_id": "e-1",
                "tp_size": 4,
                "ready": False,
                "registered_ranks": [0, 1],
                "missing_ranks": [2, 3],
                "agents": [],
            }
        ]
    )
    header, row = table.splitlines()
    assert header.split() == ["GROUP", "ROLE", "GEN", "ENGINE_ID", "READY", "LEASE_LEFT", "MISSING"]
    assert row.split() == ["prefill-0", "prefill", "3", "e-1", "2/4", "-", "2,3"]


def test_serve_refuses_unknown_store_urls_with_a_hint() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--port", "0", "--store", "redis://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "sqlite:///" in result.stderr
