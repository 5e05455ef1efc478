"""kill -9 of the service on SQLite mid-storm, then a restart on the same file: every engine
that was answered is there."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from harness.server import RegistryProcess
from tests.support.faults import FailoverClient, Storm, record, verify_nothing_lost

pytestmark = pytest.mark.faults


@pytest.mark.timeout(150)
def test_sqlite_service_killed_mid_storm_keeps_every_answered_engine(tmp_path: Path) -> None:
    server = RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}", log_path=tmp_path / "registry.log"
    ).start()
    try:

        async def main() -> tuple[Storm, float, float]:
            async with FailoverClient([server.url]) as client:
                storm = Storm(client, [f"crash-{i}" for i in range(10)], launches=8)
                task = asyncio.create_task(storm.run())
                await storm.wait_answered(30)
                t_kill = time.monotonic()
                await asyncio.to_thread(server.kill)
                await asyncio.to_thread(server.start, 60.0)
                t_up = time.monotonic()
                await asyncio.wait_for(task, 90)
                return storm, t_kill, t_up

        storm, t_kill, t_up = asyncio.run(main())
        verify_nothing_lost(server.url, storm)
        assert storm.failed_over, "no request was cut by the kill: the fault was not exercised"
        first = min(a.finished for a in storm.failed_over) - t_kill
        record(
            "sqlite_kill9_restart",
            restart_s=t_up - t_kill,
            first_success_after_kill_s=first,
            answered=len(storm.answered),
        )
    finally:
        server.kill()


@pytest.mark.timeout(60)
def test_hundred_concurrent_opens_of_one_launch_on_sqlite_open_one_generation(
    registry_server: RegistryProcess,
) -> None:
    async def main() -> list[int]:
        async with FailoverClient([registry_server.url]) as client:
            body = {"launch_id": "same-launch", "tp_size": 1, "role": "prefill"}
            answers = await asyncio.gather(
                *(client.request("PUT", "/tp-groups/same/engine", json=body) for _ in range(100))
            )
        assert {a.response.json()["generation"] for a in answers} == {1}
        return sorted(a.response.status_code for a in answers)

    assert asyncio.run(main()) == [200] * 99 + [201]
