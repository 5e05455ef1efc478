"""Concurrent requests through HTTP against one real server: one truth per group."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import Api, agent_body, launch, problem

pytestmark = pytest.mark.api

T = TypeVar("T")
WORKERS = 50


@pytest.fixture(scope="module")
def pool_client(server: RegistryProcess) -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=WORKERS, max_keepalive_connections=WORKERS)
    with httpx.Client(base_url=server.url, timeout=60.0, limits=limits) as c:
        yield c


def in_parallel(calls: list[Callable[[], T]]) -> list[T]:
    """Run every call on a bounded pool of threads, all released together."""
    go = threading.Event()

    def run(call: Callable[[], T]) -> T:
        assert go.wait(timeout=30)
        return call()

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = [pool.submit(run, call) for call in calls]
        time.sleep(0.05)  # let the first wave of threads reach the gate
        go.set()
        return [f.result(timeout=120) for f in futures]


def test_parallel_opens_with_one_launch_id_open_exactly_one_generation(
    pool_client: httpx.Client, reg: Api, gid: str
) -> None:
    body = {"launch_id": launch(), "tp_size": 8, "role": "prefill", "compat": {"m": "x"}}

    def open_once() -> tuple[int, dict[str, Any]]:
        resp = pool_client.put(f"/tp-groups/{gid}/engine", json=body)
        return resp.status_code, resp.json()

    started = time.monotonic()
    answers = in_parallel([open_once] * 200)
    elapsed = time.monotonic() - started
    statuses = Counter(status for status, _ in answers)
    assert statuses == {201: 1, 200: 199}, statuses
    assert {a["engine_id"] for _, a in answers} == {reg.engine(gid)["engine_id"]}
    assert {a["generation"] for _, a in answers} == {1}
    print(f"200 parallel opens, one launch_id: {elapsed:.2f} s")


def test_parallel_opens_with_distinct_launch_ids_leave_generations_one_to_fifty(
    pool_client: httpx.Client, api: httpx.Client, reg: Api, gid: str
) -> None:
    launches = [launch() for _ in range(50)]

    def opener(launch_id: str) -> Callable[[], httpx.Response]:
        body = {"launch_id": launch_id, "tp_size": 2, "role": "prefill"}
        return lambda: pool_client.put(f"/tp-groups/{gid}/engine", json=body)

    started = time.monotonic()
    answers = in_parallel([opener(lid) for lid in launches])
    elapsed = time.monotonic() - started
    assert Counter(r.status_code for r in answers) == {201: 50}, [r.text for r in answers][:3]
    engines = [r.json() for r in answers]
    assert sorted(e["generation"] for e in engines) == list(range(1, 51))
    assert len({e["engine_id"] for e in engines}) == 50
    assert [e["launch_id"] for e in engines] == launches

    current = reg.engine(gid)
    assert current["generation"] == 50
    listed = [g for g in api.get("/tp-groups").json()["groups"] if g["group_id"] == gid]
    assert [g["engine_id"] for g in listed] == [current["engine_id"]]
    # Exactly one engine resolves as current; every other one is superseded by it.
    resolved: Counter[int] = Counter()
    for engine in engines:
        resp = api.get(f"/engines/{engine['engine_id']}")
        resolved[resp.status_code] += 1
        if resp.status_code == 410:
            assert (
                problem(resp, 410, "engine_superseded")["current_engine_id"]
                == (current["engine_id"])
            )
    assert resolved == {200: 1, 410: 49}
    # On retry, each launch_id either is the current engine (200) or was superseded (409).
    retried: Counter[int] = Counter()
    for engine in engines:
        resp = api.put(
            f"/tp-groups/{gid}/engine",
            json={"launch_id": engine["launch_id"], "tp_size": 2, "role": "prefill"},
        )
        if engine["engine_id"] == current["engine_id"]:
            assert resp.status_code == 200, resp.text
            assert resp.json()["engine_id"] == current["engine_id"]
        else:
            body = problem(resp, 409, "launch_superseded")
            assert body["current_generation"] == 50
        retried[resp.status_code] += 1
    assert retried == {200: 1, 409: 49}
    print(f"50 parallel opens, distinct launch_ids: {elapsed:.2f} s")


def test_parallel_registrations_of_every_rank_make_the_engine_ready(
    pool_client: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=64)

    def register(rank: int) -> Callable[[], int]:
        url = f"/tp-groups/{gid}/engine/agents/{rank}"
        body = agent_body(engine["engine_id"], rank)
        return lambda: pool_client.put(url, json=body).status_code

    statuses = in_parallel([register(r) for r in range(64)] * 2)
    assert Counter(statuses) == {201: 64, 200: 64}
    view = reg.engine(gid)
    assert view["ready"] is True
    assert view["registered_ranks"] == list(range(64))


def test_opens_racing_registrations_never_leave_old_agents_on_the_new_engine(
    pool_client: httpx.Client, reg: Api, gid: str
) -> None:
    first = reg.open(gid, tp_size=16)

    def register(rank: int) -> Callable[[], int]:
        url = f"/tp-groups/{gid}/engine/agents/{rank}"
        body = agent_body(first["engine_id"], rank)
        return lambda: pool_client.put(url, json=body).status_code

    def reopen() -> int:
        body = {"launch_id": launch(), "tp_size": 16, "role": "prefill"}
        return pool_client.put(f"/tp-groups/{gid}/engine", json=body).status_code

    calls: list[Callable[[], int]] = [register(r) for r in range(16)]
    calls.insert(8, reopen)
    statuses = Counter(in_parallel(calls))
    assert statuses[201] >= 1
    assert set(statuses) <= {201, 409}, statuses
    view = reg.engine(gid)
    assert view["generation"] == 2
    assert view["registered_ranks"] == []


def test_many_waiters_all_wake_when_the_engine_becomes_ready(
    pool_client: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    reg.register(engine, 0)

    def wait() -> tuple[bool, float]:
        started = time.monotonic()
        resp = pool_client.get(f"/tp-groups/{gid}/engine", params={"wait_ready": 30})
        assert resp.status_code == 200, resp.text
        return resp.json()["ready"], time.monotonic() - started

    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [pool.submit(wait) for _ in range(20)]
        time.sleep(0.5)
        reg.register(engine, 1)
        answers = [f.result(timeout=40) for f in futures]
    assert all(ready for ready, _ in answers)
    assert max(elapsed for _, elapsed in answers) < 10
