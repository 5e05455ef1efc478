"""A worker killed: its agent's lease expires, the group stops being ready, the handshake
answers 503 naming the missing rank; the relaunched rank registers and the group is ready
again. Run on both stores (on etcd, the lease is etcd's own)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import ROOT, RegistryProcess
from tests.support.faults import agent_body, open_body, record, wait_until

pytestmark = pytest.mark.faults

TTL_S = 5  # the contract's minimum
# Expiry comes at most one TTL after the last heartbeat (sent every TTL/5, so well before
# the kill), plus the store's granularity (etcd checks leases every 0.5 s) and polling.
EXPIRY_BOUND_S = TTL_S + 2.0


@pytest.fixture(params=["sqlite", "etcd"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RegistryProcess]:
    if request.param == "etcd":
        if not etcd_available():
            pytest.skip(SKIP_REASON)
        with (
            EtcdCluster(tmp_path / "etcd") as cluster,
            RegistryProcess(cluster.url("lease"), log_path=tmp_path / "registry.log") as proc,
        ):
            yield proc
    else:
        store = f"sqlite:///{tmp_path / 'registry.db'}"
        with RegistryProcess(store, log_path=tmp_path / "registry.log") as proc:
            yield proc


def start_agent(url: str, gid: str, rank: int, engine_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.agent_proc",
            url,
            gid,
            str(rank),
            engine_id,
            "--ttl-s",
            str(TTL_S),
            "--max-life-s",
            "90",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.timeout(90)
def test_killed_worker_lease_expires_handshake_names_rank_and_relaunch_is_ready(
    server: RegistryProcess, request: pytest.FixtureRequest
) -> None:
    http = httpx.Client(base_url=server.url, timeout=30)
    gid = "lease-0"
    engine = http.put(f"/tp-groups/{gid}/engine", json=open_body(tp_size=2)).json()
    eid = engine["engine_id"]
    assert http.put(f"/tp-groups/{gid}/engine/agents/0", json=agent_body(eid, 0, 600)).is_success
    agent = start_agent(server.url, gid, 1, eid)
    try:
        ready = http.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 20}).json()
        assert ready["ready"] is True, ready
        handshake = {"tp_size": 2, "rank": 1}
        assert http.post(f"/engines/{eid}/handshake", json=handshake).status_code == 200

        # Heartbeats have renewed the lease past its first TTL: the agent is alive by them.
        time.sleep(TTL_S + 1)
        assert http.get(f"/tp-groups/{gid}/engine").json()["ready"] is True

        t_kill = time.monotonic()
        agent.kill()
        agent.wait(timeout=10)
        expired = wait_until(
            lambda: http.get(f"/tp-groups/{gid}/engine").json()["ready"] is False,
            EXPIRY_BOUND_S + 5,
            0.1,
        )
        assert expired <= EXPIRY_BOUND_S, f"lease outlived its worker by {expired:.2f} s"
        assert http.get(f"/tp-groups/{gid}/engine").json()["missing_ranks"] == [1]
        refused = http.post(f"/engines/{eid}/handshake", json=handshake)
        assert refused.status_code == 503
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["code"] == "not_ready"
        assert refused.json()["missing_ranks"] == [1]

        t_relaunch = time.monotonic()
        agent = start_agent(server.url, gid, 1, eid)
        again = http.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 20}).json()
        assert again["ready"] is True, again
        back = time.monotonic() - t_relaunch
        plan = http.post(f"/engines/{eid}/handshake", json=handshake)
        assert plan.status_code == 200
        assert [t["rank"] for t in plan.json()["targets"]] == [1]
        record(
            f"worker_kill9_lease_{request.node.callspec.params['server']}",
            ttl_s=TTL_S,
            not_ready_after_kill_s=expired,
            bound_s=EXPIRY_BOUND_S,
            ready_after_relaunch_s=back,
            since_kill_s=time.monotonic() - t_kill,
        )
    finally:
        agent.kill()
        agent.wait(timeout=10)
        http.close()
