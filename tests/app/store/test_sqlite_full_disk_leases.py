"""A full disk under a SQLite registry process (issue #49, items 1 and 3): live leases hold,
and what the registry serves after the disk is freed is what its file holds.

A real tmpfs, filled up: every commit then fails (a large write at once, the renewals' sweep
soon after), and the store reloads its file after a failed write. Renewals answered 200 must
survive those reloads (they live in memory until written), and the revisions a failed commit
used must not hide the writes that come after it from the watch feed (the list). A store that
cannot even reload (a frozen ext4 after a failed commit) answers heartbeats 503, and that
time is credited to the leases."""

from __future__ import annotations

import base64
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.faults import agent_body, record
from tests.support.hostile import (
    fill_up,
    frozen,
    log_of,
    loop_ext4,
    poll,
    serve,
    small_tmpfs,
)

pytestmark = pytest.mark.faults

TMPFS_KIB = 8192
TTL_S = 6
BEAT_S = 1.0
GROUPS = 3


def _big_agent(eid: str, rank: int) -> dict[str, Any]:
    """256 KiB of metadata: more than the WAL has room for, so its commit needs new space."""
    body = agent_body(eid, rank, ttl_s=TTL_S)
    body["agent_metadata"] = base64.b64encode(os.urandom(256 * 1024)).decode()
    return body


def _beat(http: httpx.Client, group: str, eid: str) -> int:
    resp = http.post(
        f"/tp-groups/{group}/engine/agents/heartbeat", json={"engine_id": eid, "ranks": [0, 1]}
    )
    return resp.status_code


def _open(http: httpx.Client, gid: str, tp_size: int = 2) -> str:
    body = {"launch_id": f"l-{gid}", "tp_size": tp_size, "role": "prefill"}
    opened = http.put(f"/tp-groups/{gid}/engine", json=body)
    assert opened.status_code == 201, opened.text
    engine_id: str = opened.json()["engine_id"]
    return engine_id


def _fail_a_write(http: httpx.Client, gid: str, eid: str) -> None:
    """A write the full disk cannot take: the store fails, and reloads its file."""
    failed = http.put(f"/tp-groups/{gid}/engine/agents/1", json=_big_agent(eid, 1))
    assert failed.status_code == 503, failed.text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failed_write", [True, False], ids=["a-failed-write", "renewals-only"])
def test_a_full_disk_ends_no_live_lease(tmp_path: Path, failed_write: bool) -> None:
    with small_tmpfs(tmp_path / "tmpfs", TMPFS_KIB) as disk:
        server = serve(tmp_path, disk / "registry.db")
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                engines: dict[str, str] = {}
                for i in range(GROUPS):
                    eid = engines[f"full-{i}"] = _open(http, f"full-{i}")
                    for rank in (0, 1):
                        put = http.put(
                            f"/tp-groups/full-{i}/engine/agents/{rank}",
                            json=agent_body(eid, rank, ttl_s=TTL_S),
                        )
                        assert put.status_code == 201, put.text

                # Every group renews every BEAT_S, on its own connection, for the whole run.
                answers: list[tuple[float, str, int]] = []
                stop = threading.Event()

                def renew() -> None:
                    with httpx.Client(base_url=server.url, timeout=10.0) as own:
                        while not stop.is_set():
                            for gid, eid in engines.items():
                                try:
                                    status = _beat(own, gid, eid)
                                except httpx.HTTPError:
                                    status = -1
                                answers.append((time.monotonic(), gid, status))
                            stop.wait(BEAT_S)

                renewer = threading.Thread(target=renew, name="renewer", daemon=True)
                renewer.start()
                try:
                    time.sleep(2 * BEAT_S)
                    filler = disk / "filler"
                    fill_up(filler)
                    full_at = time.monotonic()
                    if failed_write:  # the store reloads its file
                        _fail_a_write(http, "full-0", engines["full-0"])
                    # Past the ttl (twice over) on the full disk: every sweep's commit fails.
                    time.sleep(2 * TTL_S + 2)
                    filler.unlink()
                    freed_at = time.monotonic()
                    time.sleep(2 * BEAT_S)
                finally:
                    stop.set()
                    renewer.join(timeout=30)
        finally:
            server.kill()
        log = log_of(server)
    while_full = [a for a in answers if full_at <= a[0] <= freed_at]
    refused = [a for a in answers if a[2] == 404]
    record(
        f"full_disk_leases_{'failed_write' if failed_write else 'renewals_only'}",
        heartbeats_while_full=len(while_full),
        ok_while_full=sum(a[2] == 200 for a in while_full),
        unavailable_while_full=sum(a[2] == 503 for a in while_full),
        not_found=len(refused),
    )
    assert while_full, "no heartbeat was answered while the disk was full"
    # A live lease never ends: 200, or 503 (the worker retries), never 404.
    assert not refused, f"{len(refused)} of {len(answers)} heartbeats got 404, first {refused[0]}"
    assert all(a[2] in (200, 503) for a in answers), sorted({a[2] for a in answers})
    assert "disk is full" in log, "no commit failed: the disk was not full"
    if not failed_write:  # only renewals failed: memory holds them, nothing to reload
        assert "reloaded from the file" not in log


@pytest.mark.timeout(90)
def test_once_the_disk_is_freed_the_list_is_what_the_file_holds(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "tmpfs", TMPFS_KIB) as disk:
        db = disk / "registry.db"
        server = serve(tmp_path, db)
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                eid = _open(http, "before")
                filler = disk / "filler"
                fill_up(filler)
                _fail_a_write(http, "before", eid)
                filler.unlink()
                # Acknowledged once the disk is back: each must be listed.
                acknowledged = {}
                for gid in ("after-1", "after-2"):
                    body = {"launch_id": f"l-{gid}", "tp_size": 1, "role": "decode"}
                    opened, _ = poll(
                        lambda body=body, gid=gid: http.put(f"/tp-groups/{gid}/engine", json=body),
                        lambda r: r.status_code == 201,
                        10.0,
                    )
                    acknowledged[gid] = opened.json()["engine_id"]
                served, _ = poll(lambda: _listed(http), lambda got: len(got) >= 3, 5.0)
        finally:
            server.kill()
        # The file, loaded by a fresh process.
        again = serve(tmp_path, db)
        try:
            with httpx.Client(base_url=again.url, timeout=10.0) as http:
                in_file = _listed(http)
        finally:
            again.kill()
    assert in_file == {"before": eid, **acknowledged}, in_file
    assert served == in_file, f"served {served}, the file {in_file}"


def _listed(http: httpx.Client) -> dict[str, str]:
    """Every listed group's engine_id (nothing while the list answers 503)."""
    resp = http.get("/tp-groups")
    if resp.status_code != 200:
        return {}
    return {g["group_id"]: g["engine_id"] for g in resp.json()["groups"]}


@pytest.mark.timeout(120)
def test_a_store_that_cannot_reload_answers_heartbeats_503_and_ends_no_lease(
    tmp_path: Path,
) -> None:
    """A failed commit, then a disk that will not even be read (frozen): the store cannot
    reload, so heartbeats answer 503 (the worker retries) past the ttl; that time is credited
    to the leases, and once the disk is back the rank renews (200), never 404."""
    with loop_ext4(tmp_path) as mnt:
        server = serve(tmp_path, mnt / "registry.db")
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                eid = _open(http, "frozen", tp_size=1)
                put = http.put(
                    "/tp-groups/frozen/engine/agents/0", json=agent_body(eid, 0, ttl_s=TTL_S)
                )
                assert put.status_code == 201, put.text
                filler = mnt / "filler"
                fill_up(filler)
                body = _big_agent(eid, 0)
                failed = http.put("/tp-groups/frozen/engine/agents/0", json=body)
                assert failed.status_code == 503, failed.text
                statuses: list[int] = []
                with frozen(mnt):
                    until = time.monotonic() + TTL_S + 4
                    while time.monotonic() < until:
                        statuses.append(_beat_one(http, eid))
                        time.sleep(BEAT_S)
                filler.unlink()
                after, _ = poll(lambda: _beat_one(http, eid), lambda s: s != 503, 15.0)
        finally:
            server.kill()
    record("unreloadable_store_leases", heartbeats_503=statuses.count(503), after=after)
    assert set(statuses) == {503}, statuses
    assert after == 200, f"the rank's lease ended while the store could not serve: {after}"


def _beat_one(http: httpx.Client, eid: str) -> int:
    resp = http.post(
        "/tp-groups/frozen/engine/agents/0/heartbeat", json={"engine_id": eid}, timeout=10.0
    )
    return resp.status_code
