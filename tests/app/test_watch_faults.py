"""Watches under faults, with real processes: a replica killed mid-stream (the client resumes
on another one, nothing lost or doubled), etcd compacted under the watchers while their
replica's etcd member is frozen (410, relist), a consumer that stops reading (cut off, the
server's memory flat), 1,000 watchers and SIGTERM (every stream ends within a second), and
the limit on watchers, exact under a burst."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.server.settings import Settings
from harness.etcd import ETCDCTL_BIN, EtcdCluster
from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from tests.support.faults import agent_body, open_body
from tests.support.watch import ClientWatch, WatchLines

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

FAST = ["--watch-bookmark-s", "0.5", "--no-access-log", "--log-level", "warning"]


def gid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def key(event: dict[str, Any]) -> tuple[int, str, str]:
    return (int(event["revision"]), str(event["object"]["group_id"]), str(event["type"]))


def churn(url: str, groups: list[str], rounds: int, pause_s: float = 0.02) -> None:
    """Opens, registrations and relaunches over ``groups``: a change per request."""
    with httpx.Client(base_url=url, timeout=10) as c:
        for n in range(rounds):
            group = groups[n % len(groups)]
            engine = c.put(f"/tp-groups/{group}/engine", json=open_body(f"l{n // 3}")).json()
            c.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(engine["engine_id"], 0))
            time.sleep(pause_s)


def heavy_churn(url: str, requests: int, tp_size: int = 128) -> None:
    """Whole-group re-registrations of a TP ``tp_size`` group: one large change (every
    rank's agent in the engine, about 15 kB a line) per request."""
    group = gid("heavy")
    with httpx.Client(base_url=url, timeout=30) as c:
        engine = c.put(f"/tp-groups/{group}/engine", json=open_body(tp_size=tp_size)).json()
        agents = [agent_body(engine["engine_id"], r) | {"rank": r} for r in range(tp_size)]
        for _ in range(requests):
            resp = c.put(f"/tp-groups/{group}/engine/agents", json={"agents": agents})
            assert resp.status_code == 200, resp.text


def test_a_replica_killed_mid_stream_resumes_on_another_with_nothing_lost_or_doubled(
    etcd_single: EtcdCluster, tmp_path: Path
) -> None:
    store = etcd_single.url("watch-kill")
    a = RegistryProcess(store, args=FAST, log_path=tmp_path / "a.log").start()
    b = RegistryProcess(store, args=FAST, log_path=tmp_path / "b.log").start()
    try:
        start = httpx.get(f"{b.url}/tp-groups").json()["revision"]
        groups = [gid("kill") for _ in range(4)]
        with (
            httpx.Client(base_url=b.url, timeout=30) as reference_http,
            WatchLines(reference_http, {"revision": start}) as reference,
            RegistryClient([a.url, b.url], timeout_s=5) as client,
        ):
            watcher = ClientWatch(client, revision=start, idle_timeout_s=3, lost_after_s=30)
            writer = threading.Thread(target=churn, args=(b.url, groups, 60, 0.05))
            writer.start()
            watcher.wait(lambda: len(watcher.changes()) >= 15, 30, "15 changes before the kill")
            a.kill()  # kill -9, mid-stream
            killed_at = max(r for r, _, _ in watcher.changes())
            writer.join(timeout=60)
            assert not writer.is_alive()
            head = httpx.get(f"{b.url}/tp-groups").json()["revision"]
            expected: list[tuple[int, str, str]] = []
            while True:  # the uninterrupted watcher's view, up to the head
                line = reference.next(10)
                assert line is not None
                if line["type"] == "BOOKMARK" and line["revision"] >= head:
                    break
                if line["type"] != "BOOKMARK":
                    expected.append(key(line))
            watcher.wait(
                lambda: len(watcher.changes()) >= len(expected), 30, "every change up to the head"
            )
        got = watcher.changes()
        assert got == expected  # in order, each once: nothing lost, nothing doubled
        assert len(got) == len(set(got))
        assert any(r > killed_at for r, _, _ in got), "no change came after the kill"
        assert len(expected) >= 100
    finally:
        a.kill()
        b.stop()


def test_etcd_compacted_under_watchers_answers_410_and_they_relist(
    etcd_trio: EtcdCluster, tmp_path: Path
) -> None:
    # The member frozen is a follower: the other two keep quorum and a leader.
    leader = etcd_trio.leader_index()
    m0, m1, m2 = (etcd_trio.members[(leader + k) % 3] for k in (1, 0, 2))
    prefix = f"watch-compact-{uuid.uuid4().hex[:6]}"
    # The watched replica reaches etcd through m0 first; the writer through m1.
    watched = RegistryProcess(
        f"etcd://{m0.endpoint},{m1.endpoint},{m2.endpoint}/{prefix}",
        args=[*FAST, "--store-timeout", "3"],
        log_path=tmp_path / "watched.log",
    ).start()
    writer = RegistryProcess(
        f"etcd://{m1.endpoint},{m2.endpoint}/{prefix}", args=FAST, log_path=tmp_path / "w.log"
    ).start()
    assert m0.proc is not None
    frozen = False
    try:
        before = gid("old")
        with httpx.Client(base_url=writer.url, timeout=10) as w:
            w.put(f"/tp-groups/{before}/engine", json=open_body())
        start = httpx.get(f"{watched.url}/tp-groups").json()
        with (
            httpx.Client(base_url=watched.url, timeout=30) as http,
            WatchLines(http, {"revision": start["revision"]}) as raw,
            RegistryClient(watched.url, timeout_s=10) as client,
        ):
            watcher = ClientWatch(client, idle_timeout_s=5, lost_after_s=60)
            watcher.wait(lambda: watcher.events, 10, "the first SYNC")
            os.kill(m0.proc.pid, signal.SIGSTOP)  # the watched replica's member freezes
            frozen = True
            late = gid("late")
            with httpx.Client(base_url=writer.url, timeout=10) as w:
                w.put(f"/tp-groups/{late}/engine", json=open_body())
                w.put(f"/tp-groups/{gid('later')}/engine", json=open_body())
                head = w.get("/tp-groups").json()["revision"]
            subprocess.run(
                [ETCDCTL_BIN, "--endpoints", m1.endpoint, "compact", str(head), "--physical"],
                check=True,
                capture_output=True,
                timeout=15,
                env={**os.environ, "ETCDCTL_API": "3"},
            )
            # The replica's watch breaks, cannot resume (compacted), reads the groups again.
            deadline = time.monotonic() + 30
            final: dict[str, Any] | None = None
            while final is None or final["type"] != "ERROR":
                final = raw.next(max(0.01, deadline - time.monotonic()))
                assert final is not None, "the stream ended without an ERROR line"
            assert final["object"]["code"] == "revision_compacted"
            assert final["object"]["status"] == 410
            watcher.wait(lambda: sum(e.type == "SYNC" for e in watcher.events) >= 2, 30, "a relist")
            relisted = [e for e in watcher.events if e.type == "SYNC"][-1]
            assert {before, late} <= {g.group_id for g in relisted.groups}
            assert relisted.revision >= head
            os.kill(m0.proc.pid, signal.SIGCONT)
            frozen = False
            after = gid("after")
            with httpx.Client(base_url=writer.url, timeout=10) as w:
                w.put(f"/tp-groups/{after}/engine", json=open_body())
            watcher.wait(
                lambda: (
                    ("ADDED", after)
                    in {(e.type, e.engine and e.engine.group_id) for e in watcher.events}
                ),
                20,
                "a change after the relist",
            )
    finally:
        if frozen:
            os.kill(m0.proc.pid, signal.SIGCONT)
        watched.stop()
        writer.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    tmp_path = tmp_path_factory.mktemp("bounded")
    args = [*FAST, "--watch-send-budget-bytes", "65536", "--watch-max", "3"]
    args += ["--watch-history", "100"]
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    with RegistryProcess(url, args=args, log_path=tmp_path / "registry.log") as proc:
        yield proc


def test_a_consumer_that_stops_reading_is_cut_off_and_memory_stays_flat(
    bounded: RegistryProcess,
) -> None:
    heavy_churn(bounded.url, 30)  # the history and caches at their size, with no watcher
    warm = rss_kib(bounded.pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((bounded.host, bounded.port))
    sock.sendall(f"GET /tp-groups?watch=true HTTP/1.1\r\nHost: {bounded.host}\r\n\r\n".encode())
    sock.settimeout(10)
    assert b"200 OK" in sock.recv(1024)
    # The consumer reads nothing meanwhile: past the socket buffers, then the budget.
    heavy_churn(bounded.url, 30)
    deadline = time.monotonic() + 20
    while metric(bounded.url, "registry_watch_slow_consumers_closed_total") < 1:
        assert time.monotonic() < deadline, "the consumer was never cut off"
        time.sleep(0.1)
    cut = rss_kib(bounded.pid)
    heavy_churn(bounded.url, 30)  # as much again after the cut
    assert rss_kib(bounded.pid) - cut < 16 * 1024, "the server kept what it could not send"
    assert cut - warm < 16 * 1024, "the server kept what the consumer did not read"
    # Cut off after a grace of a second (app/watch/sender.py GRACE_S): then it is gone.
    deadline = time.monotonic() + 10
    while metric(bounded.url, "registry_watchers") != 0:
        assert time.monotonic() < deadline, "the cut-off watcher is still counted"
        time.sleep(0.1)
    # What reaches the consumer now ends: the connection is closed.
    ended = False
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        try:
            ended = sock.recv(65536) == b""
        except (ConnectionResetError, TimeoutError):
            ended = True
    sock.close()
    assert ended


def test_watchers_past_the_limit_are_refused_with_503(bounded: RegistryProcess) -> None:
    with httpx.Client(base_url=bounded.url, timeout=30) as c:
        streams = [WatchLines(c, {}) for _ in range(3)]
        try:
            refused = c.get("/tp-groups", params={"watch": "true"})
            assert refused.status_code == 503
            assert refused.json()["code"] == "too_many_watchers"
            assert metric(bounded.url, "registry_watchers") == 3
        finally:
            for stream in streams:
                stream.close()


def test_the_default_watch_limit_leaves_half_the_connections_to_requests(tmp_path: Path) -> None:
    args = [*FAST, "--max-connections", "16"]  # no --watch-max: the default, half
    with (
        RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", args=args) as proc,
        httpx.Client(base_url=proc.url, timeout=30) as c,
    ):
        streams = [WatchLines(c, {}) for _ in range(8)]
        try:
            with c.stream("GET", "/tp-groups", params={"watch": "true"}) as ninth:
                assert ninth.status_code == 503  # not a stream: it would hold a 9th connection
                ninth.read()
                assert ninth.json()["code"] == "too_many_watchers"
            with httpx.Client(base_url=proc.url, timeout=10) as other:
                for _ in range(4):
                    assert other.get("/metrics").status_code == 200
        finally:
            for stream in streams:
                stream.close()
    with pytest.raises(ValueError, match="must be below --max-connections 16"):
        Settings(max_connections=16, watch_max=16)


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _burst(host: str, port: int, n: int) -> list[int]:
    """``n`` watch requests sent at once; each one's status (the connections closed after)."""

    async def one() -> tuple[int, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /tp-groups?watch=true HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        return int(head.split(b" ")[1]), writer

    answers = await asyncio.gather(*(one() for _ in range(n)))
    for _, writer in answers:
        writer.close()
    return [status for status, _ in answers]


def test_a_burst_of_watches_never_passes_the_limit_together(bounded: RegistryProcess) -> None:
    # A watch counts from its admission: before, the count came when its response started,
    # so every watch of a burst passed the check before any was counted.
    statuses = asyncio.run(_burst(bounded.host, bounded.port, 30))
    assert sorted(statuses) == [200] * 3 + [503] * 27, Counter(statuses)
    deadline = time.monotonic() + 10
    while metric(bounded.url, "registry_watchers") != 0:
        assert time.monotonic() < deadline, "closed watches are still counted"
        time.sleep(0.1)


async def _open_watchers(host: str, port: int, n: int) -> list[Conn]:
    """``n`` raw watch connections (the writers kept: a collected one closes its socket)."""

    async def one() -> Conn:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /tp-groups?watch=true HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0]
        return reader, writer

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def _last_line(reader: asyncio.StreamReader) -> bytes:
    """Reads to the end of the stream; its last non-empty chunk-decoded line."""
    data = await reader.read()
    lines = [line for line in data.split(b"\r\n") if line.startswith(b"{")]
    return lines[-1] if lines else b""


def test_sigterm_ends_a_thousand_watch_streams_within_a_second(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    args = ["--watch-bookmark-s", "5", "--no-access-log", "--watch-max", "1100"]
    proc = RegistryProcess(url, args=args, log_path=tmp_path / "registry.log").start()
    try:

        async def main() -> tuple[float, list[bytes]]:
            conns = await _open_watchers(proc.host, proc.port, 1000)
            deadline = time.monotonic() + 20
            while metric(proc.url, "registry_watchers") < 1000:
                assert time.monotonic() < deadline, "not all 1,000 watchers are open"
                await asyncio.sleep(0.1)
            sent = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            lasts = await asyncio.wait_for(asyncio.gather(*(_last_line(r) for r, _ in conns)), 10)
            for _, writer in conns:
                writer.close()
            return time.monotonic() - sent, lasts

        took, lasts = asyncio.run(main())
        assert all(b'"code":"shutting_down"' in line for line in lasts), lasts[:3]
        assert took < 1.0, f"1,000 streams took {took:.2f} s to end after SIGTERM"
        assert proc.proc is not None
        proc.proc.wait(timeout=15)  # exits (uvicorn re-raises the signal: status -15)
    finally:
        proc.kill()
