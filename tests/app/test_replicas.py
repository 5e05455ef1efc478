"""Several replicas on one etcd keep the contract's guarantees (docs/api.md, "Replicas
agree"): one generation per launch, strictly increasing generations, waits that wake for
writes made through another replica."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.support.faults import FailoverClient, agent_body, open_body, record, replicas

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RegistryProcess]]:
    root: Path = tmp_path_factory.mktemp("replicas")
    with (
        EtcdCluster(root / "etcd", size=1) as cluster,
        replicas(cluster.url("replicas"), 3, root) as procs,
    ):
        yield procs


@pytest.mark.timeout(120)
def test_fifty_launches_spread_over_replicas_open_generations_one_to_fifty(
    three_replicas: list[RegistryProcess],
) -> None:
    urls = [p.url for p in three_replicas]
    gid = f"storm-{uuid.uuid4().hex[:8]}"

    async def main() -> list[httpx.Response]:
        async with FailoverClient(urls) as client:
            answers = await asyncio.gather(
                *(
                    client.request("PUT", f"/tp-groups/{gid}/engine", start=i, json=open_body())
                    for i in range(50)
                )
            )
        return [a.response for a in answers]

    t0 = time.monotonic()
    responses = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert [r.status_code for r in responses] == [201] * 50, [r.text for r in responses[:3]]
    generations = sorted(r.json()["generation"] for r in responses)
    assert generations == list(range(1, 51))
    assert len({r.json()["engine_id"] for r in responses}) == 50
    current = httpx.get(f"{urls[1]}/tp-groups/{gid}/engine", timeout=10).json()
    assert current["generation"] == 50
    record("replicas_50_distinct_launches", seconds=elapsed)


@pytest.mark.timeout(120)
def test_hundred_opens_of_one_launch_over_replicas_open_exactly_one_generation(
    three_replicas: list[RegistryProcess],
) -> None:
    urls = [p.url for p in three_replicas]
    gid = f"same-{uuid.uuid4().hex[:8]}"
    body = open_body()

    async def main() -> list[httpx.Response]:
        async with FailoverClient(urls) as client:
            answers = await asyncio.gather(
                *(
                    client.request("PUT", f"/tp-groups/{gid}/engine", start=i, json=body)
                    for i in range(100)
                )
            )
        return [a.response for a in answers]

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 99 + [201]
    assert {r.json()["engine_id"] for r in responses} == {responses[0].json()["engine_id"]}
    assert {r.json()["generation"] for r in responses} == {1}


@pytest.mark.timeout(60)
def test_wait_ready_held_on_one_replica_wakes_for_a_registration_through_another(
    three_replicas: list[RegistryProcess],
) -> None:
    a, b = three_replicas[0].url, three_replicas[2].url
    gid = f"wait-{uuid.uuid4().hex[:8]}"
    engine = httpx.put(f"{a}/tp-groups/{gid}/engine", json=open_body(), timeout=10).json()

    async def main() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(timeout=40) as http:
            held = asyncio.create_task(
                http.get(f"{a}/tp-groups/{gid}/engine", params={"wait_ready": 30})
            )
            await asyncio.sleep(1.0)
            assert not held.done(), "the wait answered before the group was ready"
            registered = await http.put(
                f"{b}/tp-groups/{gid}/engine/agents/0", json=agent_body(engine["engine_id"], 0)
            )
            assert registered.status_code == 201, registered.text
            t_registered = time.monotonic()
            answer = await asyncio.wait_for(held, 10)
            return answer, t_registered, time.monotonic()

    answer, t_registered, t_woke = asyncio.run(main())
    assert answer.status_code == 200
    assert answer.json()["ready"] is True
    wake = t_woke - t_registered
    assert wake < 2.0, f"wait_ready woke {wake:.2f} s after the registration"
    record("wait_ready_cross_replica_wake", seconds=wake, bound_s=2.0)
