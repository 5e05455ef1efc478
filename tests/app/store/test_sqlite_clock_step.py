"""A step of the wall clock under the SQLite store (issue #49, item 2): leases run on the
monotonic clock while the process runs, so an NTP step or a VM resume moves none of them.

Forward by an hour: no live lease ends (it ended every one at the next sweep when leases ran
on the wall clock). Back by an hour: a rank that stopped renewing is gone within its ttl (it
stayed listed for ttl + the step). Both in a real registry process whose ``time.time`` is
stepped through a file (a ``sitecustomize`` on its path: the machine's clock is shared and
never touched), and in process, where the file written after a step restores each lease's
time left."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.store import Put
from app.store.sqlite.store import SqliteStore
from tests.support.faults import agent_body, record
from tests.support.hostile import serve

pytestmark = [pytest.mark.faults, pytest.mark.serial]

STEP_S = 3600.0
TTL_S = 5

# Loaded by the registry process before anything else: its time.time() is the wall clock plus
# the offset the test writes into STEPPED_WALL_FILE (read every 20 ms by a daemon thread).
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, threading, time

    _path = os.environ.get("STEPPED_WALL_FILE")
    if _path:
        _real, _sleep, _offset = time.time, time.sleep, [0.0]

        def _follow():
            while True:
                try:
                    with open(_path) as f:
                        _offset[0] = float(f.read() or 0)
                except (OSError, ValueError):
                    pass
                _sleep(0.02)

        threading.Thread(target=_follow, name="stepped-wall", daemon=True).start()
        time.time = lambda: _real() + _offset[0]
    """
)


def _register(http: httpx.Client, gid: str) -> str:
    body = {"launch_id": f"l-{gid}", "tp_size": 1, "role": "prefill"}
    opened = http.put(f"/tp-groups/{gid}/engine", json=body)
    assert opened.status_code == 201, opened.text
    eid: str = opened.json()["engine_id"]
    put = http.put(f"/tp-groups/{gid}/engine/agents/0", json=agent_body(eid, 0, ttl_s=TTL_S))
    assert put.status_code == 201, put.text
    return eid


@pytest.mark.timeout(90)
def test_a_step_of_the_wall_clock_ends_no_live_lease_and_keeps_no_dead_one(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    offset = tmp_path / "wall-offset"
    offset.write_text("0")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    server = serve(
        tmp_path,
        tmp_path / "registry.db",
        env={"PYTHONPATH": path, "STEPPED_WALL_FILE": str(offset)},
    )
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            live = _register(http, "live")
            answers: list[int] = []
            stop = threading.Event()

            def renew() -> None:
                with httpx.Client(base_url=server.url, timeout=10.0) as own:
                    while not stop.is_set():
                        beat = own.post(
                            "/tp-groups/live/engine/agents/0/heartbeat", json={"engine_id": live}
                        )
                        answers.append(beat.status_code)
                        stop.wait(1.0)

            renewer = threading.Thread(target=renew, name="renewer", daemon=True)
            renewer.start()
            try:
                time.sleep(1.5)
                offset.write_text(str(STEP_S))  # forward: an NTP step, a VM resumed
                time.sleep(3.0)  # three sweeps
                forward = list(answers)
                offset.write_text(str(-STEP_S))  # and back, past where it was
                _register(http, "dead")  # registers, then never renews
                registered = time.monotonic()
                gone_after = None
                while time.monotonic() - registered < TTL_S + 10:
                    if http.get("/tp-groups/dead/engine").json()["agents"] == []:
                        gone_after = time.monotonic() - registered
                        break
                    time.sleep(0.2)
            finally:
                stop.set()
                renewer.join(timeout=15)
    finally:
        server.kill()
    record("wall_clock_step", dead_rank_gone_after_s=gone_after or -1.0)
    assert 404 not in forward, f"a live lease ended at a forward step: {forward}"
    assert set(answers) == {200}, answers
    assert gone_after is not None, f"a dead rank still listed {TTL_S + 10} s after a step back"
    assert gone_after < TTL_S + 3, gone_after


def test_a_wall_clock_step_in_process_moves_no_lease_and_the_file_keeps_its_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step.db"
    real = time.time

    async def run() -> float:
        store = SqliteStore(path, sweep_interval_s=3600)  # sweeps only when asked
        await store.start()
        try:
            lease = await store.grant_lease(TTL_S)
            assert (await store.txn([], [Put("agent/0", b"x", lease.id)])).succeeded
            monkeypatch.setattr(time, "time", lambda: real() + STEP_S)
            assert await store.purge_expired() == 0, "a forward step ended a live lease"
            assert await store.get("agent/0") is not None
            renewed = await store.refresh_lease(lease.id)
            assert renewed is not None
            assert renewed.remaining_s == TTL_S
            await asyncio.sleep(0.2)  # the renewal is written by the next commit, stepped
            assert (await store.txn([], [Put("other", b"y")])).succeeded
            monkeypatch.setattr(time, "time", lambda: real() - STEP_S)
            snap = await store.range("agent/")
            left = snap.lease_remaining_s[lease.id]
            assert TTL_S - 1 < left <= TTL_S, left
            assert snap.read_at == pytest.approx(real() - STEP_S, abs=1.0)
            return left
        finally:
            await store.close()

    asyncio.run(run())
    # Restored in a process whose wall clock is the stepped one it was written with.
    monkeypatch.setattr(time, "time", lambda: real() + STEP_S)

    async def reopen() -> float:
        store = SqliteStore(path, sweep_interval_s=3600)
        await store.start()
        try:
            snap = await store.range("agent/")
            assert [e.key for e in snap.entries] == ["agent/0"]
            return next(iter(snap.lease_remaining_s.values()))
        finally:
            await store.close()

    left = asyncio.run(reopen())
    assert TTL_S - 1.5 < left <= TTL_S, left
