"""A registry past its capacity (real processes over loopback, a real SQLite file or a real
etcd): a heartbeat that reached it while it was stalled renews its lease, a lease outlives a
restart longer than its ttl, a rank that stops renewing is still gone at its ttl, and a read
flood from several processes is shed with Retry-After while a live rank's heartbeats stay
within their budget (docs/operations.md, "Overload")."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.etcd import EtcdCluster
from harness.server import RegistryProcess
from tests.support.faults import agent_body, open_body

pytestmark = [pytest.mark.faults, pytest.mark.serial, pytest.mark.timeout(120)]

QUIET = ["--no-access-log", "--log-level", "warning"]
FLOOD = ["/status", "/tp-groups", "/events"]


def gid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The embedded store's file, or a prefix on a real single-member etcd."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    etcd: EtcdCluster = request.getfixturevalue("etcd_single")
    return etcd.url(gid("overload"))


def _live_rank(http: httpx.Client, ttl_s: int = 5) -> tuple[str, str]:
    group = gid("over")
    opened = http.put(f"/tp-groups/{group}/engine", json=open_body())
    assert opened.status_code == 201, opened.text
    engine_id = opened.json()["engine_id"]
    put = http.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(engine_id, 0, ttl_s))
    assert put.status_code == 201, put.text
    return group, engine_id


def test_a_heartbeat_queued_while_the_registry_stalled_renews_its_lease(
    store_url: str, tmp_path: Path
) -> None:
    reg = RegistryProcess(store_url, args=QUIET, log_path=tmp_path / "reg.log").start()
    try:
        with httpx.Client(base_url=reg.url, timeout=30) as http:
            group, engine_id = _live_rank(http, ttl_s=5)
            path = f"/tp-groups/{group}/engine/agents/0/heartbeat"
            assert http.post(path, json={"engine_id": engine_id}).status_code == 200
            answers: list[int] = []
            sender = threading.Thread(
                target=lambda: answers.append(
                    http.post(path, json={"engine_id": engine_id}).status_code
                )
            )
            os.kill(reg.pid, signal.SIGSTOP)  # the lease has about 5 s left
            try:
                time.sleep(2)
                sender.start()  # reaches the stopped registry with 3 s left on the lease
                time.sleep(6)  # the registry is stopped past the lease's expiry
            finally:
                os.kill(reg.pid, signal.SIGCONT)
            sender.join(20)
            assert answers == [200], f"the queued heartbeat was answered {answers}"
            again = http.post(path, json={"engine_id": engine_id})
            assert again.status_code == 200, again.text
    finally:
        reg.stop()


def test_a_lease_outlives_a_registry_restart_longer_than_its_ttl(
    store_url: str, tmp_path: Path
) -> None:
    reg = RegistryProcess(store_url, args=QUIET, log_path=tmp_path / "reg.log").start()
    try:
        with httpx.Client(base_url=reg.url, timeout=30) as http:
            group, engine_id = _live_rank(http, ttl_s=5)
            path = f"/tp-groups/{group}/engine/agents/0/heartbeat"
            assert http.post(path, json={"engine_id": engine_id}).status_code == 200
            time.sleep(1.5)  # the renewal reaches the file (the sweep, every second)
        reg.kill()  # SIGKILL: no drain, no last write
        time.sleep(7)  # down longer than the lease had left
        reg.start()
        with httpx.Client(base_url=reg.url, timeout=30) as http:
            again = http.post(path, json={"engine_id": engine_id})
            assert again.status_code == 200, f"lapsed while no registry ran: {again.text}"
    finally:
        reg.stop()


def test_a_rank_that_stops_renewing_is_gone_at_its_ttl(store_url: str, tmp_path: Path) -> None:
    """The grace is for the registry's stalls only: a rank that stops renewing is gone within
    its ttl and the sweep, though etcd keeps the lease for the grace (REGISTRY_LEASE_GRACE_S)
    past it."""
    reg = RegistryProcess(store_url, args=QUIET, log_path=tmp_path / "reg.log").start()
    try:
        with httpx.Client(base_url=reg.url, timeout=30) as http:
            group, engine_id = _live_rank(http, ttl_s=5)
            path = f"/tp-groups/{group}/engine/agents/0"
            assert http.post(f"{path}/heartbeat", json={"engine_id": engine_id}).status_code == 200
            renewed = time.monotonic()
            deadline = renewed + 30
            while http.get(f"/tp-groups/{group}/engine").json()["agents"]:
                assert time.monotonic() < deadline, "a rank that stopped renewing outlived 30 s"
                time.sleep(0.1)
            gone_after = time.monotonic() - renewed
            assert 4.5 < gone_after < 5 + 2.5, f"gone {gone_after:.1f} s after its last renewal"
            late = http.post(f"{path}/heartbeat", json={"engine_id": engine_id})
            assert late.status_code == 404, late.text
    finally:
        reg.stop()


def _flood(url: str, paths: list[str], seconds: float, concurrency: int, out: Any) -> None:
    """One process: ``concurrency`` clients reading ``paths`` in turn for ``seconds``, at a
    low CPU priority (readers elsewhere would not take the registry's CPU on these 2 cores)."""
    os.nice(5)
    counts: dict[str, int] = {}

    async def reader(client: httpx.AsyncClient, deadline: float) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                answer = await client.get(paths[n % len(paths)])
            except httpx.HTTPError:
                counts["error"] = counts.get("error", 0) + 1
                continue
            key = str(answer.status_code)
            if answer.status_code == 503:
                body = answer.json()
                after = answer.headers.get("retry-after", "")
                key = f"503 {body.get('code')} retry-after={after}"
            counts[key] = counts.get(key, 0) + 1

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(reader(client, deadline) for _ in range(concurrency)))

    asyncio.run(main())
    out.put(counts)


def test_a_read_flood_is_shed_with_retry_after_and_a_live_rank_keeps_its_lease(
    tmp_path: Path,
) -> None:
    # Past 2 seats a read is shed at once (no wait for a seat): 48 readers always exceed them.
    shedding = ["--shed-lag-s", "0.05", "--shed-in-flight", "2", "--shed-queue-s", "0"]
    args = [*QUIET, *shedding, "--shed-retry-after-s", "1"]
    reg = RegistryProcess(
        f"sqlite:///{tmp_path / 'flood.db'}", args=args, log_path=tmp_path / "reg.log"
    ).start()
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    flood_s = 8.0
    try:
        with httpx.Client(base_url=reg.url, timeout=30) as http:
            for _ in range(40):  # groups for the status page and the list pages to show
                _live_rank(http, ttl_s=30)
            group, engine_id = _live_rank(http, ttl_s=5)
            path = f"/tp-groups/{group}/engine/agents/0/heartbeat"
            readers = [
                spawn.Process(
                    target=_flood,
                    args=(reg.url, FLOOD, flood_s, 16, out),
                )
                for _ in range(3)
            ]
            for proc in readers:
                proc.start()
            took: list[float] = []
            statuses: list[int] = []
            end = time.monotonic() + flood_s + 1
            while time.monotonic() < end:  # bounded: flood_s + 1 s of heartbeats, 2 a second
                began = time.monotonic()
                statuses.append(http.post(path, json={"engine_id": engine_id}).status_code)
                took.append(time.monotonic() - began)
                time.sleep(0.5)
            counts: dict[str, int] = {}
            for proc in readers:
                for key, n in out.get(timeout=60).items():
                    counts[key] = counts.get(key, 0) + n
                proc.join(30)
            metrics = http.get("/metrics").text
    finally:
        reg.stop()
    assert set(statuses) == {200}, f"heartbeats answered {statuses}"
    assert max(took) < 2.5, f"a heartbeat took {max(took):.2f} s (budget 2.5 s): {took}"
    shed = {k: n for k, n in counts.items() if k.startswith("503")}
    assert shed, f"nothing was shed: {counts}"
    assert set(shed) == {"503 overloaded retry-after=1"}, counts
    assert counts.get("200", 0) > 0, f"no read was served at all: {counts}"
    shed_lines = [
        line for line in metrics.splitlines() if line.startswith("registry_shed_requests_total{")
    ]
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in shed_lines)
    assert counted >= sum(shed.values()), (shed_lines, shed)  # every one counted, by route
    assert all(any(f'route="{p}"' in line for p in FLOOD) for line in shed_lines), shed_lines
