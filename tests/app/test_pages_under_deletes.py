"""List pages read while groups are deleted and opened again, on a real etcd (a page reads its
leases' time left from etcd, an await during which the feed changes): no page answers 500
(a group deleted during that await was a KeyError)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from harness.etcd import EtcdCluster
from harness.server import RegistryProcess
from tests.support.faults import agent_body, open_body
from workers.tools.procs import log_tail

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

GROUPS = 120
WALK_S = 12.0


def populate(c: httpx.Client, prefix: str) -> list[str]:
    names = [f"{prefix}-{n:03d}" for n in range(GROUPS)]
    for name in names:
        engine = c.put(f"/tp-groups/{name}/engine", json=open_body()).json()
        body = agent_body(engine["engine_id"], 0, ttl_s=60)
        assert c.put(f"/tp-groups/{name}/engine/agents/0", json=body).status_code == 201
    return names


def churn(url: str, names: list[str], stop: threading.Event, counts: Counter[str]) -> None:
    """Deletes a group and opens it again (with an agent), round the fleet, until ``stop``."""
    with httpx.Client(base_url=url, timeout=10) as c:
        n = 0
        while not stop.is_set():
            name = names[n % len(names)]
            n += 1
            counts["delete"] += c.delete(f"/tp-groups/{name}").status_code == 204
            engine = c.put(f"/tp-groups/{name}/engine", json=open_body()).json()
            body = agent_body(engine["engine_id"], 0, ttl_s=60)
            counts["open"] += c.put(f"/tp-groups/{name}/engine/agents/0", json=body).is_success


def test_pages_read_under_concurrent_deletes_never_fail(
    etcd_single: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_single.url(f"pages-{uuid.uuid4().hex[:6]}")
    args = ["--no-access-log", "--log-level", "warning"]
    # Writes go through one replica, pages through another: the page's replica knows none of
    # the new leases and asks etcd for each (a replica knows the leases it granted itself).
    with (
        RegistryProcess(url, args=args, log_path=tmp_path / "writer.log") as writer,
        RegistryProcess(url, args=args, log_path=tmp_path / "registry.log") as proc,
        httpx.Client(base_url=proc.url, timeout=30) as c,
    ):
        with httpx.Client(base_url=writer.url, timeout=30) as w:
            names = populate(w, "pg")
        stop = threading.Event()
        counts: Counter[str] = Counter()
        writers = [
            threading.Thread(target=churn, args=(writer.url, names[k::2], stop, counts))
            for k in range(2)
        ]
        for thread in writers:
            thread.start()
        statuses: Counter[int] = Counter()
        walks = 0
        try:
            deadline = time.monotonic() + WALK_S
            while time.monotonic() < deadline:
                params: dict[str, str | int] = {"limit": 7}
                walks += 1
                while True:
                    resp = c.get("/tp-groups", params=params)
                    statuses[resp.status_code] += 1
                    if resp.status_code != 200:
                        break
                    page = resp.json()
                    if page["continue"] is None:
                        break
                    params["continue"] = page["continue"]
        finally:
            stop.set()
            for thread in writers:
                thread.join(timeout=30)
        assert counts["delete"] > 20, counts  # the deletes raced the pages
        assert set(statuses) == {200}, (statuses, walks, log_tail(tmp_path / "registry.log"))
