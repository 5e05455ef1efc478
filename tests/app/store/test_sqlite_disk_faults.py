"""The SQLite store's disk failing under a real registry process (issue #15): a stalled
(frozen) filesystem, a read-only one that becomes writable again, a full one, and the database
file deleted under the running server. Each is answered in bounded time with 503
``store_unavailable`` (``/healthz`` unaffected, ``/readyz`` saying so), and writes work again
once the disk is back, without a restart.

Real filesystems: a loop-mounted ext4 image (``fsfreeze``, ``mount -o remount,ro``) and a small
tmpfs; these need root (see :func:`tests.support.hostile.require_root`). Every mount is undone
and every freeze thawed in ``finally`` blocks."""

from __future__ import annotations

import base64
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.support.faults import agent_body, record
from tests.support.hostile import (
    STORE_TIMEOUT_S,
    assert_problem,
    fill_up,
    frozen,
    json_log_lines,
    log_of,
    loop_ext4,
    open_engine,
    poll,
    remount,
    serve,
    small_tmpfs,
)

pytestmark = pytest.mark.faults

# A request that needs the store answers within the store timeout and this margin.
MARGIN_S = 1.5
WRITE_BOUND_S = STORE_TIMEOUT_S + MARGIN_S
# How long a read that should take 1 s is waited for, to see what it answers instead.
READ_PATIENCE_S = STORE_TIMEOUT_S
# Once the disk is back, writes work again within this (no restart).
RECOVERY_S = 5.0


def is_write_ok(resp: httpx.Response) -> bool:
    return resp.status_code in (200, 201)


def bounded(
    http: httpx.Client, method: str, path: str, *, bound_s: float = WRITE_BOUND_S, **kwargs: Any
) -> tuple[Any, float]:
    """One request, the client giving up 2 s past ``bound_s``; returns the answer (or the
    transport error) and its seconds."""
    t0 = time.monotonic()
    try:
        answer: Any = http.request(method, path, timeout=bound_s + 2.0, **kwargs)
    except httpx.HTTPError as exc:
        answer = exc
    return answer, time.monotonic() - t0


def expect_503_within(
    what: str, answer: Any, seconds: float, bound_s: float, broken: list[str]
) -> dict[str, Any] | None:
    """Collect what is wrong with a store_unavailable answer into ``broken``."""
    if not isinstance(answer, httpx.Response):
        broken.append(f"{what}: no answer after {seconds:.2f} s ({type(answer).__name__})")
        return None
    try:
        body = assert_problem(answer, 503, "store_unavailable")
    except AssertionError as exc:
        broken.append(f"{what}: after {seconds:.2f} s: {exc}")
        return None
    if seconds > bound_s:
        broken.append(f"{what}: 503 after {seconds:.2f} s (bound {bound_s:.1f} s)")
    return body


Call = tuple[str, str, str, Any]  # what, method, path, JSON body


def concurrently(
    server: RegistryProcess, calls: list[Call], bound_s: float = WRITE_BOUND_S
) -> list[tuple[str, Any, float]]:
    """Each call on its own connection, all at once (``bounded``); in the calls' order."""

    def one(call: Call) -> tuple[str, Any, float]:
        what, method, path, body = call
        with httpx.Client(base_url=server.url) as own:
            answer, seconds = bounded(own, method, path, bound_s=bound_s, json=body)
        return what, answer, seconds

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


@contextmanager
def healthz_prober(server: RegistryProcess, patience_s: float = 1.0) -> Iterator[list[float]]:
    """Asks ``/healthz`` every 0.1 s on its own connection for the block; yields the latencies
    (a request that failed or ran out of patience counts as ``patience_s + 1``)."""
    latencies: list[float] = []
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=server.url, timeout=patience_s) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.monotonic() - t0 if ok else patience_s + 1)
                stop.wait(0.1)

    thread = threading.Thread(target=run, name="healthz-prober", daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(timeout=patience_s + 5)


# -- 2. a stalled disk -------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_frozen_disk_leaves_healthz_and_reads_fast_and_bounds_writes_and_readyz_with_503(
    tmp_path: Path,
) -> None:
    with loop_ext4(tmp_path) as mnt:
        server = serve(tmp_path, mnt / "registry.db")
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                open_engine(http, "quiet")  # a group no write touches while frozen
                engine = open_engine(http, "stalled", tp_size=2)
                group, eid = engine["group_id"], engine["engine_id"]
                put = http.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0))
                assert put.status_code == 201, put.text
                assert http.get(f"/tp-groups/{group}/engine").status_code == 200
                # A write just before the freeze: the next read then finds WAL frames that no
                # reader has marked yet (SQLite writes a read mark into the -shm file).
                beat = http.post(
                    f"/tp-groups/{group}/engine/agents/0/heartbeat", json={"engine_id": eid}
                )
                assert beat.status_code == 200, beat.text

                broken: list[str] = []
                with frozen(mnt), healthz_prober(server) as healthz:
                    check_frozen(server, group, eid, broken)
                slowest = max(healthz, default=0.0)
                if slowest >= 1.0:
                    broken.append(f"/healthz took {slowest:.2f} s (or failed) while frozen")

                # Thawed: writes work again, no restart.
                _, took = poll(
                    lambda: http.put(
                        f"/tp-groups/{group}/engine/agents/1",
                        json=agent_body(eid, 1),
                        timeout=WRITE_BOUND_S,
                    ),
                    is_write_ok,
                    RECOVERY_S,
                )
                poll(lambda: http.get("/readyz"), lambda r: r.status_code == 200, RECOVERY_S)
                record("frozen_disk", healthz_max_s=slowest, write_ok_after_thaw_s=took)
                assert not broken, "\n".join(broken)
        finally:
            server.kill()


def check_frozen(server: RegistryProcess, group: str, eid: str, broken: list[str]) -> None:
    """While frozen: reads of both groups, three store calls at once, the reads again (a
    group whose write is stuck answers 503 within the bound; an untouched one from memory)."""

    def read(when: str, group_written: bool) -> None:
        # Both groups at once; patient enough to see what a read that misses its 1 s
        # bound answers in the end (the store timeout's 503, say).
        reads: list[Call] = [
            (f"GET the group {when}", "GET", f"/tp-groups/{group}/engine", None),
            (f"GET an untouched group {when}", "GET", "/tp-groups/quiet/engine", None),
        ]
        for what, answer, seconds in concurrently(server, reads, bound_s=READ_PATIENCE_S):
            status = answer.status_code if isinstance(answer, httpx.Response) else answer
            if group_written and what.startswith("GET the group"):
                # Its latest change never reached the disk: the contract's "never a stale
                # answer" makes this read need the store, so it is bounded by a 503.
                expect_503_within(what, answer, seconds, WRITE_BOUND_S, broken)
            elif status != 200 or seconds > 1.0:
                broken.append(f"{what}: {status!r} after {seconds:.2f} s")

    read("as the disk froze", group_written=False)

    writes: list[Call] = [
        ("register an agent", "PUT", f"/tp-groups/{group}/engine/agents/1", agent_body(eid, 1)),
        (
            "open an engine",
            "PUT",
            "/tp-groups/stalled-new/engine",
            {"launch_id": "l-new", "tp_size": 1, "role": "prefill"},
        ),
        ("/readyz", "GET", "/readyz", None),
    ]

    for what, answer, seconds in concurrently(server, writes):
        expect_503_within(what, answer, seconds, WRITE_BOUND_S, broken)

    read("after writes to the group timed out", group_written=True)


# -- 7. a read-only filesystem that comes back -------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("left_by", ["clean stop", "kill -9"])
def test_a_store_on_a_read_only_disk_answers_503_and_writes_resume_once_it_is_writable(
    tmp_path: Path, left_by: str
) -> None:
    with loop_ext4(tmp_path) as mnt:
        db = mnt / "registry.db"
        first = serve(tmp_path, db)
        with httpx.Client(base_url=first.url, timeout=10.0) as http:
            engine = open_engine(http, "readonly")
        if left_by == "clean stop":
            first.stop()
        else:
            first.kill()
        remount(mnt, "ro")
        server = serve(tmp_path, db)
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                broken: list[str] = []
                calls: list[Call] = [
                    (
                        "open an engine",
                        "PUT",
                        "/tp-groups/readonly-new/engine",
                        {"launch_id": "l-ro", "tp_size": 1, "role": "prefill"},
                    ),
                    (
                        "register an agent",
                        "PUT",
                        "/tp-groups/readonly/engine/agents/0",
                        agent_body(engine["engine_id"], 0),
                    ),
                ]
                for what, answer, seconds in concurrently(server, calls):
                    expect_503_within(f"{what} (read-only)", answer, seconds, WRITE_BOUND_S, broken)
                assert not broken, "\n".join(broken)

                remount(mnt, "rw")
                _, took = poll(
                    lambda: http.put(
                        "/tp-groups/readonly-new/engine",
                        json={"launch_id": "l-ro", "tp_size": 1, "role": "prefill"},
                        timeout=WRITE_BOUND_S,
                    ),
                    is_write_ok,
                    RECOVERY_S,
                )
                put = http.put(
                    "/tp-groups/readonly/engine/agents/0", json=agent_body(engine["engine_id"], 0)
                )
                assert put.status_code == 201, put.text
                record(f"read_only_disk_{left_by.replace(' ', '_')}", write_ok_after_rw_s=took)
        finally:
            server.kill()


# -- 8. a full disk ----------------------------------------------------------------------------

FULL_TMPFS_KIB = 4096


@pytest.mark.timeout(60)
def test_a_full_disk_answers_writes_503_saying_so_and_recovers_once_space_is_freed(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "tmpfs", FULL_TMPFS_KIB) as disk:
        server = serve(tmp_path, disk / "registry.db")
        try:
            with httpx.Client(base_url=server.url, timeout=10.0) as http:
                engine = open_engine(http, "full", tp_size=2)
                group, eid = engine["group_id"], engine["engine_id"]
                put = http.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0))
                assert put.status_code == 201, put.text

                filler = disk / "filler"
                fill_up(filler)
                # 256 KiB of metadata: more than the WAL has room for, so it needs new space.
                big = agent_body(eid, 1)
                big["agent_metadata"] = base64.b64encode(os.urandom(256 * 1024)).decode()
                broken: list[str] = []
                answer, seconds = bounded(
                    http, "PUT", f"/tp-groups/{group}/engine/agents/1", json=big
                )
                body = expect_503_within(
                    "write on a full disk", answer, seconds, WRITE_BOUND_S, broken
                )
                if body is not None and "full" not in body["detail"].lower():
                    broken.append(f"the 503 does not say the disk is full: {body['detail']!r}")
                ready, seconds = bounded(http, "GET", "/readyz")
                expect_503_within("/readyz on a full disk", ready, seconds, WRITE_BOUND_S, broken)
                assert not broken, "\n".join(broken)

                filler.unlink()
                _, took = poll(
                    lambda: http.put(
                        f"/tp-groups/{group}/engine/agents/1", json=big, timeout=WRITE_BOUND_S
                    ),
                    is_write_ok,
                    RECOVERY_S,
                )
                poll(lambda: http.get("/readyz"), lambda r: r.status_code == 200, RECOVERY_S)
                record("full_disk", write_ok_after_free_s=took)
        finally:
            server.kill()


# -- 9. the database file deleted under the server ---------------------------------------------

DELETED = re.compile(r"delet|replac|remov|unlink|missing|gone", re.IGNORECASE)


@pytest.mark.timeout(60)
def test_deleting_the_database_file_under_the_server_answers_writes_503_and_logs_an_error(
    tmp_path: Path,
) -> None:
    db = tmp_path / "store" / "registry.db"
    server = serve(tmp_path, db, args=["--log-level", "info"])
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            engine = open_engine(http, "deleted", tp_size=2)
            group, eid = engine["group_id"], engine["engine_id"]
            put = http.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0))
            assert put.status_code == 201, put.text

            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)

            broken: list[str] = []
            calls: list[Call] = [
                (
                    "open an engine",
                    "PUT",
                    "/tp-groups/deleted-new/engine",
                    {"launch_id": "l-del", "tp_size": 1, "role": "prefill"},
                ),
                (
                    "register an agent",
                    "PUT",
                    f"/tp-groups/{group}/engine/agents/1",
                    agent_body(eid, 1),
                ),
            ]
            for what, answer, seconds in concurrently(server, calls):
                problem = expect_503_within(what, answer, seconds, WRITE_BOUND_S, broken)
                if problem is not None and not DELETED.search(problem["detail"]):
                    broken.append(f"{what}: the 503 does not say the file went: {problem}")
            ready, seconds = bounded(http, "GET", "/readyz")
            expect_503_within("/readyz", ready, seconds, WRITE_BOUND_S, broken)

            def error_logged() -> list[dict[str, Any]]:
                return [
                    e
                    for e in json_log_lines(log_of(server))
                    if e.get("level") in {"error", "critical"} and DELETED.search(str(e))
                ]

            deadline = time.monotonic() + 3.0
            while not error_logged() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not error_logged():
                broken.append("no error line in the log says the database file was deleted")
            assert not broken, "\n".join(broken)
    finally:
        server.kill()
