"""A lease that runs out is a ``lease_expired`` event when the registry ends it, stamped then
(issue #53, item 1): read from ``GET /events`` alone, with no ``/metrics`` scrape or
``/status`` render in between, on a real registry process over SQLite and over a real etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, new_gid

pytestmark = pytest.mark.api

TTL_S = 5


@contextmanager
def _registry(tmp_path: Path, backend: str) -> Iterator[RegistryProcess]:
    if backend == "sqlite":
        with RegistryProcess(
            f"sqlite:///{tmp_path / 'registry.db'}", log_path=tmp_path / "registry.log"
        ) as proc:
            yield proc
        return
    with (
        EtcdCluster(tmp_path / "etcd", size=1) as etcd,
        RegistryProcess(etcd.url("expiry"), log_path=tmp_path / "registry.log") as proc,
    ):
        yield proc


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["at"].replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("etcd", marks=pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)),
    ],
)
def test_a_lease_that_ran_out_is_an_event_at_its_end_without_any_scrape(
    tmp_path: Path, backend: str
) -> None:
    gid = new_gid("expiry")
    with _registry(tmp_path, backend) as proc, httpx.Client(base_url=proc.url, timeout=30) as c:
        body = {"launch_id": "l-expiry", "tp_size": 3, "role": "prefill"}
        opened = c.put(f"/tp-groups/{gid}/engine", json=body)
        assert opened.status_code == 201, opened.text
        eid = opened.json()["engine_id"]
        put = c.put(f"/tp-groups/{gid}/engine/agents/0", json=agent_body(eid, 0, ttl_s=TTL_S))
        assert put.status_code == 201, put.text
        # Ranks 1 and 2 in one batch: one lease for both.
        batch = {"agents": [{"rank": r, **agent_body(eid, r, ttl_s=TTL_S)} for r in (1, 2)]}
        put = c.put(f"/tp-groups/{gid}/engine/agents", json=batch)
        assert put.status_code == 200, put.text
        registered = time.time()
        # Rank 0 renews; ranks 1 and 2 stopped (their node died). Only /events is read.
        expired: list[dict[str, Any]] = []
        deadline = time.monotonic() + TTL_S + 15
        while time.monotonic() < deadline:
            beat = c.post(f"/tp-groups/{gid}/engine/agents/0/heartbeat", json={"engine_id": eid})
            assert beat.status_code == 200, beat.text
            answer = c.get("/events", params={"limit": 1000})
            assert answer.status_code == 200, answer.text
            expired = [
                e
                for e in answer.json()["events"]
                if e["kind"] == "lease_expired" and e["group_id"] == gid
            ]
            if expired:
                break
            time.sleep(0.5)
        time.sleep(2.0)  # any second event of the same expiry would be written by now
        events = c.get("/events", params={"limit": 1000}).json()["events"]
    expired = [e for e in events if e["kind"] == "lease_expired" and e["group_id"] == gid]
    assert sorted(e["fields"]["rank"] for e in expired) == [1, 2], expired
    for event in expired:
        assert event["fields"]["engine_id"] == eid
        assert event["count"] == 1
        # Stamped when the registry ended the lease: its ttl after the registration, plus the
        # sweep's (or the reaper's) interval and a loaded machine's margin.
        late = _at(event) - (registered + TTL_S)
        assert -0.5 <= late <= 3.0, f"recorded {late:.2f} s after the lease's expiry"
