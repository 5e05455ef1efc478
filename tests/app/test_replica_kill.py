"""kill -9 of one replica during a storm of launches: clients fail over to another replica
and nothing that was answered is lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from harness.etcd import EtcdCluster
from tests.support.faults import FailoverClient, Storm, record, replicas, verify_nothing_lost

pytestmark = pytest.mark.faults


@pytest.mark.timeout(150)
def test_replica_killed_mid_storm_clients_fail_over_and_nothing_answered_is_lost(
    etcd_single: EtcdCluster, tmp_path: Path
) -> None:
    with replicas(etcd_single.url("kill"), 3, tmp_path) as procs:
        urls = [p.url for p in procs]

        async def main() -> tuple[Storm, float]:
            async with FailoverClient(urls) as client:
                storm = Storm(client, [f"kill-{i}" for i in range(12)], launches=8)
                task = asyncio.create_task(storm.run())
                await storm.wait_answered(25)
                t_kill = time.monotonic()
                await asyncio.to_thread(procs[0].kill)
                await asyncio.wait_for(task, 90)
                return storm, t_kill

        storm, t_kill = asyncio.run(main())
        verify_nothing_lost(urls[1], storm)
        assert storm.failed_over, "no request hit the killed replica: the fault was not exercised"
        first = min(a.finished for a in storm.failed_over) - t_kill
        worst = max(a.finished - a.started for a in storm.failed_over)
        assert worst < 5.0, f"a failover took {worst:.2f} s"
        record(
            "replica_kill9_failover",
            first_success_after_kill_s=first,
            worst_failed_over_request_s=worst,
            failed_over_requests=len(storm.failed_over),
            answered=len(storm.answered),
            bound_s=5.0,
        )
