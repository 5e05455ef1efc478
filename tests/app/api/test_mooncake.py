"""The Mooncake bootstrap routes (app/api/routes/mooncake.py) over real HTTP: generations per
engine id, supersession in one step, the query's shape, leases of the rank's agent. vLLM's own
connector code drives them in tests/workers/vllm_plugin/test_mooncake_bootstrap.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.app.api.conftest import Api, invalid, problem, sqlite_url

pytestmark = [pytest.mark.api, pytest.mark.timeout(90)]


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    """Each test on both stores: the workers' keys live beside the groups' (``mooncake/``)."""
    d = tmp_path_factory.mktemp(f"mooncake-{request.param}")
    if request.param == "sqlite":
        with RegistryProcess(sqlite_url(d), log_path=d / "registry.log") as proc:
            yield proc
        return
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    with (
        EtcdCluster(d / "etcd", size=1) as cluster,
        RegistryProcess(cluster.url("mc"), log_path=d / "registry.log") as proc,
    ):
        yield proc


def worker(
    engine_id: str, tp: int = 0, *, dp: int = 0, pp: int = 0, port: int = 0
) -> dict[str, Any]:
    return {
        "engine_id": engine_id,
        "dp_rank": dp,
        "tp_rank": tp,
        "pp_rank": pp,
        "addr": f"tcp://127.0.0.1:{port or 20000 + tp}",
    }


def query(api: httpx.Client, engine_id: str) -> httpx.Response:
    return api.get(f"/mooncake/{engine_id}/query")


def test_a_plain_launch_opens_a_generation_and_a_relaunch_supersedes_it(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    first = f"{gid}~{uuid.uuid4().hex}"
    for tp in (0, 1):
        resp = api.post("/register", json=worker(first, tp))
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"status": "ok"}
    engine = reg.engine(gid)
    assert (engine["engine_id"], engine["generation"], engine["role"]) == (first, 1, "prefill")
    assert query(api, first).json() == {
        "0": {
            "engine_id": first,
            "worker_addr": {
                "0": {"0": "tcp://127.0.0.1:20000"},
                "1": {"0": "tcp://127.0.0.1:20001"},
            },
        }
    }
    second = f"{gid}~{uuid.uuid4().hex}"
    assert api.post("/register", json=worker(second, 0, port=21000)).status_code == 200
    assert reg.engine(gid)["generation"] == 2
    assert query(api, second).json() == {
        "0": {"engine_id": second, "worker_addr": {"0": {"0": "tcp://127.0.0.1:21000"}}}
    }
    gone = problem(query(api, first), 410, "engine_superseded")
    assert second in gone["detail"]
    # the old launch's rank 1, late: refused, and the new generation keeps only its own
    problem(api.post("/register", json=worker(first, 1)), 410, "engine_superseded")
    assert list(query(api, second).json()["0"]["worker_addr"]) == ["0"]


def test_data_parallel_ranks_share_one_engine(api: httpx.Client, gid: str) -> None:
    base = f"{gid}~{uuid.uuid4().hex}"
    for dp in (0, 1):
        body = worker(f"{base}_dp{dp}", 0, dp=dp, port=22000 + dp)
        assert api.post("/register", json=body).status_code == 200, body
    answer = query(api, base).json()
    assert answer["1"] == {
        "engine_id": f"{base}_dp1",
        "worker_addr": {"0": {"0": "tcp://127.0.0.1:22001"}},
    }
    assert answer["0"]["engine_id"] == f"{base}_dp0"


def test_an_issued_engine_takes_workers_and_its_agents_leases(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2)
    eid = engine["engine_id"]
    for tp in (0, 1):
        assert api.post("/register", json=worker(eid, tp)).status_code == 200
    assert query(api, eid).json() == {}  # no agent yet: not answered
    reg.register(engine, 0, ttl_s=5)  # rank 0's agent, its lease not renewed
    reg.register(engine, 1)  # rank 1's, 600 s
    assert sorted(query(api, eid).json()["0"]["worker_addr"]) == ["0", "1"]
    t0 = time.monotonic()
    while time.monotonic() < t0 + 30:  # rank 0's lease ends: its worker leaves the answer
        if sorted(query(api, eid).json()["0"]["worker_addr"]) == ["1"]:
            break
        time.sleep(0.25)
    assert sorted(query(api, eid).json()["0"]["worker_addr"]) == ["1"]


def test_unknown_engines_and_bad_workers_are_refused(api: httpx.Client, gid: str) -> None:
    detail = problem(api.post("/register", json=worker(str(uuid.uuid4()))), 404, "not_found")
    assert "<group>~<launch>" in detail["detail"]
    problem(query(api, str(uuid.uuid4())), 404, "not_found")
    good = f"{gid}~x"
    for field, value in [
        ("addr", "127.0.0.1:5"),
        ("addr", "tcp://0.0.0.0:5"),
        ("tp_rank", -1),
        ("engine_id", "a/b"),
    ]:
        invalid(api.post("/register", json={**worker(good), field: value}))
    invalid(api.post("/register", json={**worker(good), "extra": 1}))
    problem(query(api, good), 404, "not_found")  # nothing was opened


def test_deleting_the_group_ends_its_workers(api: httpx.Client, gid: str) -> None:
    eid = f"{gid}~{uuid.uuid4().hex}"
    assert api.post("/register", json=worker(eid)).status_code == 200
    assert api.delete(f"/tp-groups/{gid}").status_code == 204
    problem(query(api, eid), 404, "not_found")
    # the same launch again is a new group of its own
    assert api.post("/register", json=worker(eid)).status_code == 200
    assert query(api, eid).json()["0"]["engine_id"] == eid


def test_two_launches_racing_leave_one_generation_with_its_own_workers(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    launches = [f"{gid}~{uuid.uuid4().hex}" for _ in range(2)]
    jobs = [(eid, tp) for tp in range(8) for eid in launches]

    def post(job: tuple[str, int]) -> tuple[str, int, int]:
        eid, tp = job
        with httpx.Client(base_url=str(api.base_url), timeout=30) as own:
            return eid, tp, own.post("/register", json=worker(eid, tp)).status_code

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, jobs))
    engine = reg.engine(gid)
    current = engine["engine_id"]
    assert engine["generation"] == 2
    (old,) = [eid for eid in launches if eid != current]
    problem(query(api, old), 410, "engine_superseded")
    assert all(code == 200 for eid, _, code in answers if eid == current), answers
    answered = {str(tp) for eid, tp, code in answers if eid == current}
    assert set(query(api, current).json()["0"]["worker_addr"]) == answered
    assert {code for eid, _, code in answers if eid == old} <= {200, 410}
