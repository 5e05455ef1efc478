"""Revocation ends what a token holds open: a real registry process, a real tokens file. A
reader token dropped from the file (SIGHUP, or the file's change on its own) ends its open watch
streams within a second of the reload with a final ``ERROR`` line, code ``unauthorized``, and
the stream closes; a watch opened by a token still in force streams on."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.support.faults import open_body
from tests.support.watch import WatchLines

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]

ADMIN = "admin-" + uuid.uuid4().hex
WORKER = "worker-" + uuid.uuid4().hex
KEPT = "reader-kept-" + uuid.uuid4().hex
DROPPED = "reader-dropped-" + uuid.uuid4().hex
BOUND_S = 1.0  # the contract: a revoked token's streams end within a second of the reload


def write_tokens(path: Path, *readers: str) -> None:
    # Plain role:token lines: each token is called by its line (the dropped reader: reader#4).
    lines = [f"admin:{ADMIN}", f"worker:{WORKER}", *(f"reader:{token}" for token in readers)]
    path.write_text("".join(f"{line}\n" for line in lines))
    settled = time.time() - 5  # SIGHUP reads a file that held still for a second
    os.utime(path, (settled, settled))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[RegistryProcess, Path]]:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, KEPT, DROPPED)
    args = ["--tokens-file", str(tokens), "--watch-bookmark-s", "0.3", "--no-access-log"]
    store = f"sqlite:///{tmp_path / 'registry.db'}"
    with RegistryProcess(store, args=args, log_path=tmp_path / "registry.log") as proc:
        yield proc, tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def until_end(watch: WatchLines, deadline_s: float) -> tuple[list[dict[str, Any]], float]:
    """Every line until the stream ends (or the deadline): the lines and when it ended."""
    lines: list[dict[str, Any]] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            line = watch.next(max(0.01, end - time.monotonic()))
        except Exception:  # queue.Empty at the deadline, or the connection cut
            break
        if line is None:
            return lines, time.monotonic()
        lines.append(line)
    raise AssertionError(
        f"the revoked token's stream still open {deadline_s} s after the reload; it sent "
        f"{len(lines)} lines: {lines[-3:]}"
    )


def change(api: httpx.Client) -> None:
    group = f"rv-{uuid.uuid4().hex[:8]}"
    assert api.put(f"/tp-groups/{group}/engine", json=open_body()).status_code == 201


@pytest.mark.parametrize("trigger", ["SIGHUP", "file changed"])
def test_a_dropped_token_s_watch_streams_end_within_a_second_with_unauthorized(
    server: tuple[RegistryProcess, Path], trigger: str
) -> None:
    proc, tokens = server
    with (
        httpx.Client(base_url=proc.url, timeout=30.0, headers=bearer(WORKER)) as api,
        httpx.Client(base_url=proc.url, timeout=30.0) as watching,
        WatchLines(watching, {}, headers=bearer(DROPPED)) as revoked,
        WatchLines(watching, {}, headers=bearer(DROPPED)) as revoked_too,
        WatchLines(watching, {}, headers=bearer(KEPT)) as kept,
    ):
        change(api)
        for watch in (revoked, revoked_too, kept):
            assert watch.changes(1)[0]["type"] == "ADDED"
        write_tokens(tokens, KEPT)
        if trigger == "SIGHUP":
            reloaded = time.monotonic()
            os.kill(proc.pid, signal.SIGHUP)
        else:  # no signal: the poller sees the change, then reloads it once it holds still
            reloaded = time.monotonic() + 2.0
        for watch in (revoked, revoked_too):
            lines, ended = until_end(watch, BOUND_S + (reloaded - time.monotonic()) + 0.5)
            assert ended - reloaded < BOUND_S, (trigger, ended - reloaded)
            final = lines[-1]
            assert final["type"] == "ERROR", lines
            problem = final["object"]
            assert (problem["code"], problem["status"]) == ("unauthorized", 401), problem
            assert "'reader#4'" in problem["detail"]
            assert DROPPED not in problem["detail"]
        assert watching.get("/tp-groups", headers=bearer(DROPPED)).status_code == 401
        # The token still in force streams on: the next change reaches it.
        change(api)
        assert kept.changes(1)[0]["type"] == "ADDED"
