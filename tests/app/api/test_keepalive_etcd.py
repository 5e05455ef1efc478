"""``GET /keepalive`` on a registry on a real etcd: every renewal waits on etcd (a gRPC call),
so the protocol's renewal goes on as a task (``app/server/bypass/inline.py``) and the messages
read meanwhile wait their turn. Pipelined renewals are answered one each, in order; a lease
renewed only over the stream outlives its ttl.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, new_gid
from tests.support.streams import renew_pipelined

pytestmark = [
    pytest.mark.api,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON),
]


def test_pipelined_renewals_on_etcd_are_answered_in_order(tmp_path: Path) -> None:
    with (
        EtcdCluster(tmp_path / "etcd", size=1) as cluster,
        RegistryProcess(cluster.url("ka"), log_path=tmp_path / "registry.log") as server,
        httpx.Client(base_url=server.url, timeout=30.0) as api,
    ):
        group = new_gid("ka-etcd")
        body = {"launch_id": uuid.uuid4().hex, "tp_size": 2, "role": "prefill"}
        opened = api.put(f"/tp-groups/{group}/engine", json=body)
        assert opened.status_code in (200, 201), opened.text
        engine_id = opened.json()["engine_id"]
        agents = [agent_body(engine_id, r, ttl_s=5) | {"rank": r} for r in range(2)]
        put = api.put(f"/tp-groups/{group}/engine/agents", json={"agents": agents})
        assert put.status_code == 200, put.text
        url = server.url.replace("http://", "ws://") + "/keepalive"
        asked = [[0], [1], None, [0, 1], [1], [0]]
        with connect(url, open_timeout=5, proxy=None, compression=None) as ws:
            started = time.monotonic()
            while time.monotonic() - started < 7:  # past the ttl (5 s)
                renew_pipelined(ws, group, engine_id, asked)
                time.sleep(1.0)
        live = api.get(f"/tp-groups/{group}/engine")
        assert live.status_code == 200, live.text
        assert sorted(a["rank"] for a in live.json()["agents"]) == [0, 1]
