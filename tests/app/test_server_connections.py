"""Connections against a real registry process (issue #15): held long-polls at SIGTERM, idle
and slow connections, oversized request heads, and more idle connections than the process has
descriptors. Real sockets on loopback; every wait is bounded.

The server's connection guards are settings like every other (``REGISTRY_`` variables): the
header timeout (``REGISTRY_HEADER_TIMEOUT_S``) is set short here so that the tests run in
seconds; one test keeps the default and only asks that an idle connection goes within 65 s."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import selectors
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.support.hostile import (
    FAST_PATHS,
    PROBLEM,
    log_of,
    open_engine,
    path_env,
    require_tools,
    serve,
    socket_fds,
    vm_rss_kib,
)

pytestmark = pytest.mark.faults

HEADER_TIMEOUT_S = 2.0
SHORT_HEADERS = {"REGISTRY_HEADER_TIMEOUT_S": f"{HEADER_TIMEOUT_S:g}"}
# How long past the header timeout a silent connection may stay open.
CLOSE_MARGIN_S = 3.0
# With the default settings, an idle connection goes within this.
DEFAULT_IDLE_BOUND_S = 65.0


@pytest.fixture(params=FAST_PATHS)
def short_headers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RegistryProcess]:
    """With the fast path on and off (its wire path is a base of the protocol class)."""
    env = path_env(request.param, **SHORT_HEADERS)
    server = serve(tmp_path, tmp_path / "registry.db", env=env)
    try:
        yield server
    finally:
        server.kill()


def connect(port: int, timeout_s: float = 2.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- 5. SIGTERM with held long-polls -----------------------------------------------------------

HELD = 50


@pytest.mark.timeout(60)
def test_sigterm_answers_every_held_long_poll_with_json_within_3_s_and_exits_within_5_s(
    tmp_path: Path,
) -> None:
    server = serve(tmp_path, tmp_path / "registry.db")
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            engine = open_engine(http, "held", tp_size=2)
        answers, exited_after = asyncio.run(hold_then_terminate(server, engine["group_id"]))
    finally:
        server.kill()

    problems: Counter[str] = Counter()
    for status, ctype, body, after in answers:
        media = (ctype or "").split(";")[0]
        if status is None:
            problems[f"no answer within 3 s ({body})"] += 1
        elif after > 3.0:
            problems[f"{status} only after {after:.1f} s"] += 1
        elif status == 200 and media == "application/json":
            if body.get("engine_id") != engine["engine_id"]:
                problems[f"200 with another engine: {body}"] += 1
        elif not (status == 503 and media == PROBLEM):
            problems[f"{status} {media!r} {str(body)[:80]}"] += 1
    broken = [f"{n} of {HELD} held requests: {what}" for what, n in problems.items()]
    if exited_after is None:
        broken.append("the process did not exit within 5 s of SIGTERM")
    log = log_of(server)
    if "Traceback" in log:
        at = log.index("Traceback")
        broken.append(f"a traceback in the server's log: {log[max(0, at - 200) : at + 300]}")
    assert not broken, "\n".join(broken)


async def hold_then_terminate(
    server: RegistryProcess, group: str
) -> tuple[list[tuple[int | None, str | None, Any, float]], float | None]:
    """``HELD`` long-polls on a group that will not be ready, SIGTERM once all are held;
    returns each answer (status, content-type, body, seconds after SIGTERM) and the seconds
    the process took to exit (None: still running 5 s after SIGTERM)."""
    assert server.proc is not None
    proc = server.proc
    sent_term = 0.0
    limits = httpx.Limits(max_connections=HELD + 10)
    async with httpx.AsyncClient(base_url=server.url, timeout=40.0, limits=limits) as client:

        async def one() -> tuple[int | None, str | None, Any, float]:
            try:
                resp = await client.get(f"/tp-groups/{group}/engine", params={"wait_ready": 30})
            except httpx.HTTPError as exc:
                return None, None, f"{type(exc).__name__}: {exc}", time.monotonic() - sent_term
            try:
                body: Any = resp.json()
            except ValueError:
                body = resp.text
            return (
                resp.status_code,
                resp.headers.get("content-type"),
                body,
                (time.monotonic() - sent_term),
            )

        baseline = socket_fds(proc.pid)
        tasks = [asyncio.create_task(one()) for _ in range(HELD)]
        # Held: the server has accepted every connection (then a moment to parse and park
        # each request), however loaded the machine.
        for _ in range(150):  # 15 s at most
            if socket_fds(proc.pid) >= baseline + HELD:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        early = [t.result() for t in tasks if t.done()]
        assert not early, f"long-polls answered before SIGTERM: {early[:3]}"
        sent_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        done, pending = await asyncio.wait(tasks, timeout=3.5)
        for task in pending:
            task.cancel()
        answers = [
            t.result() if t in done else (None, None, "still waiting", time.monotonic() - sent_term)
            for t in tasks
        ]
    exited_after: float | None = None
    while time.monotonic() - sent_term < 5.0:
        if proc.poll() is not None:
            exited_after = time.monotonic() - sent_term
            break
        await asyncio.sleep(0.05)
    return answers, exited_after


# -- 6a. idle and slow connections -------------------------------------------------------------


def silent_and_slow_connections(port: int, count: int) -> list[tuple[str, socket.socket]]:
    """Half send nothing at all; half start a request and never finish its headers."""
    conns = []
    for i in range(count):
        sock = connect(port)
        if i % 2:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: registry\r\nX-Slow: ")
            conns.append(("partial headers", sock))
        else:
            conns.append(("silent", sock))
    return conns


def wait_closed(conns: list[tuple[str, socket.socket]], bound_s: float) -> dict[int, float]:
    """Seconds until the server closed each connection (EOF or reset), for those it closed
    within ``bound_s``; whatever the server sends first (a 408) is read and ignored."""
    closed: dict[int, float] = {}
    t0 = time.monotonic()
    with selectors.DefaultSelector() as sel:
        for i, (_, sock) in enumerate(conns):
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, i)
        while len(closed) < len(conns):
            left = bound_s - (time.monotonic() - t0)
            if left <= 0:
                break
            for key, _ in sel.select(timeout=min(left, 1.0)):
                i = int(key.data)
                try:
                    data = conns[i][1].recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed[i] = time.monotonic() - t0
                    sel.unregister(conns[i][1])
    return closed


def assert_all_closed(
    conns: list[tuple[str, socket.socket]], closed: dict[int, float], bound_s: float
) -> None:
    still = [f"#{i} ({kind})" for i, (kind, _) in enumerate(conns) if i not in closed]
    assert not still, (
        f"{len(still)} of {len(conns)} idle connections still open after {bound_s:g} s: "
        f"{', '.join(still)}"
    )


@pytest.mark.timeout(60)
def test_silent_and_slow_connections_are_closed_soon_after_the_header_timeout(
    short_headers: RegistryProcess,
) -> None:
    conns = silent_and_slow_connections(short_headers.port, 8)
    try:
        bound = HEADER_TIMEOUT_S + CLOSE_MARGIN_S
        closed = wait_closed(conns, bound)
        assert_all_closed(conns, closed, bound)
        assert min(closed.values()) >= HEADER_TIMEOUT_S * 0.5, "closed before the timeout"
    finally:
        for _, sock in conns:
            sock.close()
    assert httpx.get(f"{short_headers.url}/healthz", timeout=5.0).status_code == 200


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (head and content-length body) from ``sock``; its status line."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection instead of answering"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")[1:]
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    assert len(body) == length, "more bytes than one answer"
    return head.split(b"\r\n", 1)[0]


# The watchdog's period is the shorter of the head and body timeouts: 1 s here.
KEEP_ALIVE_ENV = {
    "REGISTRY_KEEP_ALIVE_S": "2",
    "REGISTRY_HEADER_TIMEOUT_S": "1",
}


@pytest.mark.timeout(60)
def test_an_idle_keep_alive_connection_closes_after_keep_alive_s_and_requests_keep_it_open(
    tmp_path: Path,
) -> None:
    keep_alive_s = float(KEEP_ALIVE_ENV["REGISTRY_KEEP_ALIVE_S"])
    period_s = float(KEEP_ALIVE_ENV["REGISTRY_HEADER_TIMEOUT_S"])
    server = serve(tmp_path, tmp_path / "registry.db", env=KEEP_ALIVE_ENV)
    try:
        with connect(server.port, timeout_s=15.0) as sock:
            # A request every half second for longer than the keep-alive: each answer restarts its
            # clock, so the connection outlives it.
            for _ in range(int(keep_alive_s * 2) + 1):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                assert read_answer(sock) == b"HTTP/1.1 200 OK"
                time.sleep(0.5)
            idle_since = time.monotonic() - 0.5
            # Then idle: closed after the keep-alive, give or take the watchdog's period;
            # recv answers b"" at the close (bounded by the socket's timeout).
            assert sock.recv(1) == b""
            idle = time.monotonic() - idle_since
        assert idle >= keep_alive_s * 0.9, f"closed {idle:.1f} s idle, before the keep-alive"
        assert idle <= keep_alive_s + period_s + CLOSE_MARGIN_S, f"open {idle:.1f} s idle"
    finally:
        server.kill()


@pytest.mark.timeout(120)
def test_a_connection_that_never_sends_is_closed_within_65_s_with_the_default_settings(
    tmp_path: Path,
) -> None:
    server = serve(tmp_path, tmp_path / "registry.db")
    try:
        conns = silent_and_slow_connections(server.port, 6)
        try:
            closed = wait_closed(conns, DEFAULT_IDLE_BOUND_S)
            assert_all_closed(conns, closed, DEFAULT_IDLE_BOUND_S)
        finally:
            for _, sock in conns:
                sock.close()
    finally:
        server.kill()


# -- 6b. oversized request heads ---------------------------------------------------------------

MIB = 1 << 20


def send_head(port: int, head: bytes) -> tuple[int | None, str]:
    """Send ``head`` (an unterminated or complete request head); returns the answer's status
    (None when the server closed or reset the connection without one) and what happened."""
    sock = connect(port, timeout_s=5.0)
    try:
        try:
            sock.sendall(head)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        if not data:
            return None, "closed without an answer"
        return int(data.split(b" ", 2)[1]), data.split(b"\r\n", 1)[0].decode("latin-1")
    except TimeoutError:
        return -1, "no answer and still open after 5 s"
    finally:
        sock.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["header line", "request target"])
def test_a_request_head_of_1_mib_is_refused(short_headers: RegistryProcess, where: str) -> None:
    big = b"a" * MIB
    if where == "header line":
        head = b"GET /healthz HTTP/1.1\r\nHost: registry\r\nX-Big: " + big + b"\r\n\r\n"
    else:
        head = b"GET /healthz?" + big + b" HTTP/1.1\r\nHost: registry\r\n\r\n"
    status, what = send_head(short_headers.port, head)
    assert status in (None, 400, 431), f"a 1 MiB {where}: {what}"
    assert httpx.get(f"{short_headers.url}/healthz", timeout=5.0).status_code == 200


CLIENTS = 10
HEAD_BYTES = 20 * MIB
RSS_GROWTH_LIMIT_KIB = 50 * 1024


@pytest.mark.timeout(90)
def test_ten_clients_sending_20_mib_header_lines_do_not_grow_the_server_by_50_mib(
    short_headers: RegistryProcess,
) -> None:
    assert short_headers.proc is not None
    pid = short_headers.proc.pid
    before = vm_rss_kib(pid)
    peak = before
    socks: list[socket.socket] = []
    sent = [0] * CLIENTS
    refused_at_connect: list[str] = []
    stop = threading.Event()
    deadline = time.monotonic() + 15.0

    def flood(i: int) -> None:
        # A slow reader is waited for (until the deadline); only a close or reset ends early.
        try:
            sock = connect(short_headers.port, timeout_s=2.0)
        except OSError as exc:
            refused_at_connect.append(f"client {i}: {exc!r}")
            return
        socks.append(sock)
        sock.settimeout(0.5)
        data = memoryview(
            b"GET /healthz HTTP/1.1\r\nHost: registry\r\nX-Flood: " + b"b" * HEAD_BYTES
        )
        while sent[i] < len(data) and time.monotonic() < deadline and not stop.is_set():
            try:
                sent[i] += sock.send(data[sent[i] : sent[i] + 65536])
            except TimeoutError:
                continue
            except OSError:
                return  # refused: closed or reset

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline + 5:
            peak = max(peak, vm_rss_kib(pid))
            time.sleep(0.05)
        peak = max(peak, vm_rss_kib(pid))
        stop.set()
        for t in threads:
            t.join(timeout=5)
        grown = peak - before
        assert grown <= RSS_GROWTH_LIMIT_KIB, (
            f"the server's RSS grew by {grown / 1024:.0f} MiB (from {before / 1024:.0f} MiB) "
            f"while {CLIENTS} clients sent {sum(sent) / MIB:.0f} MiB of unfinished header lines"
        )
        assert len(refused_at_connect) < CLIENTS, refused_at_connect
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    assert httpx.get(f"{short_headers.url}/healthz", timeout=5.0).status_code == 200


# -- 6c. more idle connections than descriptors ------------------------------------------------

IDLE = 1100
NOFILE = 1024


def raise_own_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


@pytest.mark.timeout(90)
def test_with_1100_idle_connections_under_a_1024_descriptor_limit_a_client_is_still_served(
    tmp_path: Path,
) -> None:
    require_tools("prlimit")
    raise_own_nofile(IDLE + 512)
    server = serve(
        tmp_path,
        tmp_path / "registry.db",
        env=SHORT_HEADERS,
        prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"],
    )
    idle: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        refused = 0
        while len(idle) + refused < IDLE and time.monotonic() - t0 < 15.0:
            try:
                idle.append(connect(server.port, timeout_s=1.0))
            except OSError:
                refused += 1
        # The server may close idle ones (that is the point); the client must get in.
        budget = HEADER_TIMEOUT_S + 10.0
        served = serve_one_client(server, budget)
        assert served is None, (
            f"with {len(idle)} idle connections open ({refused} refused at connect), {served}"
        )
    finally:
        for sock in idle:
            sock.close()
        server.kill()


def serve_one_client(server: RegistryProcess, budget_s: float) -> str | None:
    """A legitimate client: /healthz 200, then an engine opened (201), retried on connection
    errors and 503s until ``budget_s``; None when served, else what it last got."""
    t0 = time.monotonic()
    last = "nothing"
    steps: list[tuple[str, str, dict[str, Any] | None, int]] = [
        ("GET", "/healthz", None, 200),
        (
            "PUT",
            "/tp-groups/crowded/engine",
            {"launch_id": "l-crowd", "tp_size": 1, "role": "prefill"},
            201,
        ),
    ]
    for method, path, body, want in steps:
        while True:
            left = budget_s - (time.monotonic() - t0)
            if left <= 0:
                return f"{method} {path} not served within {budget_s:g} s (last: {last})"
            try:
                with httpx.Client(base_url=server.url, timeout=min(left, 5.0)) as http:
                    resp = http.request(method, path, json=body)
                last = f"{resp.status_code} {resp.text[:120]}"
                if resp.status_code in (want, 200):
                    break
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
    return None
