"""SIGTERM with a watcher behind (a burst of changes answered just before it): the stream
sends what the history holds for it before its final ``shutting_down`` line, so the watcher
resumes on the registry restarted on the same SQLite file without listing again, and sees
every change once; a consumer that stopped reading holds neither the others nor the exit.
Real registry processes, the workers' watch client, loopback HTTP."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from tests.support.faults import agent_body, open_body
from tests.support.watch import ClientWatch, WatchLines

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

RESTARTS = 8  # each: a burst, SIGTERM, a restart on the same file
BURST = 25  # groups opened right before each SIGTERM


def opened(url: str, groups: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        for group in groups:
            resp = http.put(f"/tp-groups/{group}/engine", json=open_body())
            assert resp.status_code in (200, 201), resp.text


def test_a_watcher_behind_at_sigterm_resumes_after_the_restart_without_listing_again(
    tmp_path: Path,
) -> None:
    log = tmp_path / "registry.log"
    args = ["--log-level", "info", "--watch-bookmark-s", "5"]
    proc = RegistryProcess(f"sqlite:///{tmp_path / 'registry.db'}", args=args, log_path=log)
    proc.start()
    expected: list[str] = []
    relisted: list[int] = []  # the restarts after which the watcher listed again
    try:
        with RegistryClient(proc.url, timeout_s=5) as client:
            watcher = ClientWatch(client, idle_timeout_s=5, lost_after_s=60)
            first = f"first-{uuid.uuid4().hex[:6]}"
            opened(proc.url, [first])
            watcher.wait_for(first, 15)
            expected.append(first)
            for n in range(RESTARTS):
                syncs = watcher.syncs()
                burst = [f"b{n}-{k}-{uuid.uuid4().hex[:6]}" for k in range(BURST)]
                opened(proc.url, burst)  # the watcher is some of these behind ...
                proc.stop()  # ... at SIGTERM
                proc.start()
                marker = f"after{n}-{uuid.uuid4().hex[:6]}"
                opened(proc.url, [marker])
                watcher.wait_for(marker, 30)
                expected += [*burst, marker]
                if watcher.syncs() > syncs:
                    relisted.append(n)
        assert not relisted, f"listed again after {len(relisted)} of {RESTARTS} restarts"
        assert watcher.syncs() == 1
        assert watcher.added() == expected  # every change once, in order
    finally:
        proc.kill()


def test_a_consumer_that_stopped_reading_holds_neither_the_drain_nor_the_exit(
    tmp_path: Path,
) -> None:
    args = ["--no-access-log", "--watch-bookmark-s", "5"]
    proc = RegistryProcess(f"sqlite:///{tmp_path / 'registry.db'}", args=args).start()
    stalled = socket.socket()
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((proc.host, proc.port))
        request = f"GET /tp-groups?watch=true HTTP/1.1\r\nHost: {proc.host}\r\n\r\n"
        stalled.sendall(request.encode())
        stalled.settimeout(10)
        assert b"200 OK" in stalled.recv(1024)
        with httpx.Client(base_url=proc.url, timeout=30) as http:
            # About 1 MB of lines (a TP 128 group registered again and again): past the
            # stalled consumer's socket buffers and its connection's, within its budget.
            big = f"big-{uuid.uuid4().hex[:6]}"
            engine = http.put(f"/tp-groups/{big}/engine", json=open_body(tp_size=128)).json()
            agents = [agent_body(engine["engine_id"], r) | {"rank": r} for r in range(128)]
            for _ in range(60):
                resp = http.put(f"/tp-groups/{big}/engine/agents", json={"agents": agents})
                assert resp.status_code == 200, resp.text
            with WatchLines(http, {}) as reader:
                burst = [f"b-{k}-{uuid.uuid4().hex[:6]}" for k in range(BURST)]
                opened(proc.url, burst)
                assert proc.proc is not None
                sent = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                lines: list[dict[str, Any]] = []
                while not lines or lines[-1]["type"] != "ERROR":
                    line = reader.next(10)
                    assert line is not None, f"the stream ended without an ERROR line: {lines}"
                    lines.append(line)
                final = lines[-1]
                proc.proc.wait(timeout=15)
                exited = time.monotonic() - sent
        changes = [line for line in lines if line["type"] in ("ADDED", "MODIFIED", "DELETED")]
        assert [c["object"]["group_id"] for c in changes] == burst
        assert final["object"]["code"] == "shutting_down"
        assert final["revision"] == changes[-1]["revision"]
        # Ended at once (not sent to), then cut off after its grace: well within uvicorn's
        # 10 s for the connections at shutdown.
        assert exited < 5, f"the registry took {exited:.1f} s to exit after SIGTERM"
    finally:
        stalled.close()
        proc.kill()
