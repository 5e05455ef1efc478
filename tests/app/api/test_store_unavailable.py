"""503 store_unavailable: the store does not answer, and every request that needs it says so
within the operator's bound (``--store-timeout``), then recovers."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import launch, new_gid, problem, sqlite_url

pytestmark = pytest.mark.api

TIMEOUT_S = 1.0


@pytest.fixture
def locked_server(tmp_path: Path) -> Iterator[tuple[RegistryProcess, Path]]:
    proc = RegistryProcess(
        sqlite_url(tmp_path),
        args=["--store-timeout", str(TIMEOUT_S)],
        log_path=tmp_path / "registry.log",
    )
    with proc:
        yield proc, tmp_path / "registry.db"


def test_writes_answer_503_within_the_bound_while_another_process_holds_the_lock(
    locked_server: tuple[RegistryProcess, Path],
) -> None:
    server, db = locked_server
    gid = new_gid()
    body = {"launch_id": launch(), "tp_size": 1, "role": "prefill"}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/readyz").status_code == 200  # the file exists, in WAL mode
        holder = sqlite3.connect(db, isolation_level=None, timeout=5)
        try:
            holder.execute("BEGIN IMMEDIATE")
            started = time.monotonic()
            resp = c.put(f"/tp-groups/{gid}/engine", json=body)
            elapsed = time.monotonic() - started
            problem(resp, 503, "store_unavailable")
            assert elapsed < TIMEOUT_S + 2.5, elapsed
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        # Retry-safe: the same launch_id opens exactly one generation once the store is back.
        deadline = time.monotonic() + 10
        while True:
            resp = c.put(f"/tp-groups/{gid}/engine", json=body)
            if resp.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert resp.status_code in {200, 201}, resp.text
        assert resp.json()["generation"] == 1
        again = c.put(f"/tp-groups/{gid}/engine", json=body)
        assert again.status_code == 200
        assert again.json()["engine_id"] == resp.json()["engine_id"]


def test_a_store_that_cannot_open_answers_503_everywhere_it_is_needed(tmp_path: Path) -> None:
    not_a_file = tmp_path / "dir.db"
    not_a_file.mkdir()
    with (
        RegistryProcess(
            f"sqlite:///{not_a_file}",
            args=["--store-timeout", str(TIMEOUT_S)],
            log_path=tmp_path / "registry.log",
        ) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert c.get("/healthz").status_code == 200
        problem(c.get("/readyz"), 503, "store_unavailable")
        gid = new_gid()
        problem(c.get("/tp-groups"), 503, "store_unavailable")
        started = time.monotonic()
        problem(
            c.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 30}), 503, "store_unavailable"
        )
        assert time.monotonic() - started < TIMEOUT_S + 2.5
        body = {"launch_id": launch(), "tp_size": 1, "role": "prefill"}
        problem(c.put(f"/tp-groups/{gid}/engine", json=body), 503, "store_unavailable")
        problem(c.get("/engines/e"), 503, "store_unavailable")
        problem(
            c.post("/engines/e/handshake", json={"tp_size": 1, "rank": 0}),
            503,
            "store_unavailable",
        )
        # Shape errors still answer 422 first; /metrics still serves, saying the store is down.
        problem(c.put(f"/tp-groups/{gid}/engine", content=b"{"), 422, "invalid_request")
        metrics = c.get("/metrics")
        assert metrics.status_code == 200
        assert "registry_store_up 0.0" in metrics.text
