"""Durability with real processes: a real kill -9 of a real server, then a restart on the same
SQLite file. Every engine answered 200/201 before the kill is there after it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import Api, blob, launch, new_gid, problem, sqlite_url

pytestmark = pytest.mark.api


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RegistryProcess]:
    proc = RegistryProcess(sqlite_url(tmp_path), log_path=tmp_path / "registry.log")
    with proc:
        yield proc


def kill_and_restart(server: RegistryProcess) -> float:
    """SIGKILL the server, start it again on the same file and port; seconds to serve again."""
    assert server.proc is not None
    pid = server.proc.pid
    server.kill(signal.SIGKILL)
    started = time.monotonic()
    server.start()
    assert server.proc is not None
    assert server.proc.pid != pid
    return time.monotonic() - started


def test_answered_engines_and_agents_survive_kill_9(server: RegistryProcess) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        reg = Api(c)
        for i in range(6):
            gid = new_gid("durable")
            groups[gid] = [reg.open(gid, tp_size=2 + i % 3) for _ in range(1 + i % 3)]
            current = groups[gid][-1]
            reg.register_all(current, list(range(current["tp_size"] - i % 2)))
        before = {gid: reg.engine(gid) for gid in groups}

    restart_s = kill_and_restart(server)
    print(f"restart after kill -9: {restart_s:.2f} s")

    with httpx.Client(base_url=server.url, timeout=10) as c:
        reg = Api(c)
        checked = 0
        for gid, engines in groups.items():
            current = reg.engine(gid)
            # Same engine, same generation, same live agents (their leases run on).
            for key in ("engine_id", "generation", "launch_id", "tp_size", "registered_ranks"):
                assert current[key] == before[gid][key], (gid, key)
            for old in engines[:-1]:
                body = problem(c.get(f"/engines/{old['engine_id']}"), 410, "engine_superseded")
                assert body["current_engine_id"] == current["engine_id"]
                retry = c.put(
                    f"/tp-groups/{gid}/engine",
                    json={
                        "launch_id": old["launch_id"],
                        "tp_size": old["tp_size"],
                        "role": "prefill",
                    },
                )
                problem(retry, 409, "launch_superseded")
                checked += 1
            resolved = c.get(f"/engines/{current['engine_id']}")
            assert resolved.status_code == 200
            assert resolved.json()["generation"] == current["generation"]
            # rank 0's retry after the restart gets its engine again: 200, not a new one.
            latest = engines[-1]
            again = c.put(
                f"/tp-groups/{gid}/engine",
                json={
                    "launch_id": latest["launch_id"],
                    "tp_size": latest["tp_size"],
                    "role": "prefill",
                },
            )
            assert again.status_code == 200, again.text
            assert again.json()["engine_id"] == latest["engine_id"]
            checked += 1
            for rank in current["registered_ranks"]:
                beat = c.post(
                    f"/tp-groups/{gid}/engine/agents/{rank}/heartbeat",
                    json={"engine_id": current["engine_id"]},
                )
                assert beat.status_code == 200, beat.text
            if current["ready"]:
                hs = c.post(
                    f"/engines/{current['engine_id']}/handshake", json={"tp_size": 1, "rank": 0}
                )
                assert hs.status_code == 200, hs.text
                for t in hs.json()["targets"]:
                    assert t["agent_metadata"] == blob(t["rank"], current["engine_id"])
            # Generations keep increasing across the restart; engine_ids are never reused.
            nxt = reg.open(gid, tp_size=2)
            assert nxt["generation"] == current["generation"] + 1
            assert nxt["engine_id"] not in {e["engine_id"] for e in engines}
        print(f"engines checked after kill -9: {checked}")


def test_engines_answered_during_a_storm_survive_kill_9_mid_storm(
    server: RegistryProcess,
) -> None:
    group_ids = [new_gid("storm") for _ in range(4)]
    answered: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def storm() -> None:
        with httpx.Client(base_url=server.url, timeout=5) as c:
            i = 0
            while not stop.is_set():
                gid = group_ids[i % len(group_ids)]
                i += 1
                body = {"launch_id": launch(), "tp_size": 2, "role": "prefill"}
                try:
                    resp = c.put(f"/tp-groups/{gid}/engine", json=body)
                except httpx.HTTPError:
                    return  # the server died under us; this open's fate is unknown
                if resp.status_code not in {200, 201}:
                    errors.append(AssertionError(resp.text))
                    return
                answered.append(resp.json())

    thread = threading.Thread(target=storm, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(answered) < 150 and thread.is_alive():
        assert time.monotonic() < deadline, f"only {len(answered)} opens answered"
        time.sleep(0.01)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)  # mid-storm: the thread is still opening
    thread.join(timeout=15)
    stop.set()
    assert not thread.is_alive()
    assert not errors, errors
    snapshot = list(answered)
    server.kill(signal.SIGKILL)  # reap it
    started = time.monotonic()
    server.start()
    restart_s = time.monotonic() - started

    with httpx.Client(base_url=server.url, timeout=10) as c:
        latest: dict[str, int] = {}
        for engine in snapshot:
            gid, gen = engine["group_id"], engine["generation"]
            latest[gid] = max(latest.get(gid, 0), gen)
        current = {gid: Api(c).engine(gid) for gid in latest}
        for engine in snapshot:
            resp = c.get(f"/engines/{engine['engine_id']}")
            now = current[engine["group_id"]]
            if resp.status_code == 200:
                assert resp.json()["generation"] == engine["generation"]
                assert resp.json()["engine_id"] == now["engine_id"]
            else:
                body = problem(resp, 410, "engine_superseded")
                assert body["current_generation"] > engine["generation"]
        for gid, gen in latest.items():
            # One opener per group at a time: at most the one unanswered open landed.
            assert current[gid]["generation"] in {gen, gen + 1}, (gid, gen, current[gid])
            gens = sorted(e["generation"] for e in snapshot if e["group_id"] == gid)
            assert gens == list(range(1, gen + 1)), gid
    print(
        f"storm: {len(snapshot)} answered opens before kill -9, all present after restart "
        f"({restart_s:.2f} s)"
    )
