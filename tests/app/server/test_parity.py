"""The HTTP and WebSocket limits, the same with the fast path on and off (issue #50): each case
runs against a real registry process with ``REGISTRY_FAST_PATH`` true and false and must give
the same answer within the same bound. A chunked body on a hot GET, renewals flooding a
keep-alive stream (on etcd: what waits is bounded; on SQLite: other clients are still served),
a stream whose client stops reading (its idle or ping deadline ends it and frees its slot), a
text frame that is not UTF-8 (1007), frames of every kind and size, bodies past the limit.
Memory is the server process's RSS (``/proc/<pid>/status``); every sender stops early once
the bound is passed."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from harness.etcd import EtcdCluster
from harness.server import RegistryProcess
from tests.support.faults import agent_body
from tests.support.hostile import FAST_PATHS, RawStream, drain, path_env, vm_rss_kib, ws_frame

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

GROWTH_BOUND_MIB = 64  # what a flood may add to the server's RSS (the full stack: ~1 MiB)
# 64 KB frames: the allocator's heap settles about 100 MiB up on both paths; a queue grows on
FRAME_BOUND_MIB = 160
MIB = 1 << 20


@pytest.fixture(params=FAST_PATHS)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def start(tmp_path: Path, mode: str, store: str = "", **env: str) -> RegistryProcess:
    store = store or f"sqlite:///{tmp_path / 'registry.db'}"
    return RegistryProcess(store, env=path_env(mode, **env), log_path=tmp_path / "log")


def launch(api: httpx.Client, group: str, ranks: int) -> str:
    body = {"launch_id": uuid.uuid4().hex, "tp_size": ranks, "role": "prefill"}
    opened = api.put(f"/tp-groups/{group}/engine", json=body)
    assert opened.status_code == 201, opened.text
    engine_id: str = opened.json()["engine_id"]
    agents = [agent_body(engine_id, r, ttl_s=600) | {"rank": r} for r in range(ranks)]
    put = api.put(f"/tp-groups/{group}/engine/agents", json={"agents": agents})
    assert put.status_code == 200, put.text
    return engine_id


def growth_mib(pid: int, base_kib: int) -> float:
    return (vm_rss_kib(pid) - base_kib) / 1024


def renewal(group: str, engine_id: str, ranks: list[int]) -> bytes:
    return json.dumps([group, engine_id, ranks]).encode()


# -- 1. a hot GET with a chunked body -------------------------------------------------------


def test_a_chunked_body_on_a_hot_get_is_not_held_and_the_get_answers(
    tmp_path: Path, mode: str
) -> None:
    with start(tmp_path, mode) as proc, httpx.Client(base_url=proc.url, timeout=10) as api:
        launch(api, "g", 1)
        assert proc.proc is not None
        pid, base = proc.proc.pid, vm_rss_kib(proc.proc.pid)
        chunk = b"100000\r\n" + b"x" * MIB + b"\r\n"  # 1 MiB a chunk
        grew, sent = 0.0, 0
        with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as sock:
            sock.sendall(
                b"GET /tp-groups/g/engine HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for sent in range(1, 257):  # 256 MiB at most
                sock.sendall(chunk)
                if sent % 8 == 0 and (grew := growth_mib(pid, base)) > GROWTH_BOUND_MIB:
                    break
            grew = max(grew, growth_mib(pid, base))
            assert grew <= GROWTH_BOUND_MIB, f"{sent} MiB sent: the registry grew {grew:.0f} MiB"
            sock.sendall(b"0\r\n\r\n")
            head = b""
            while b"\r\n" not in head:
                got = sock.recv(4096)
                assert got, "closed without an answer"
                head += got
        assert head.split(b" ", 2)[1] == b"200", head[:200]
        assert api.get("/tp-groups/g/engine").status_code == 200


# -- 2. renewals flooding a stream on etcd ----------------------------------------------------


def test_renewals_flooding_a_stream_on_etcd_wait_unread_within_a_bound(
    tmp_path: Path, mode: str, etcd_single: EtcdCluster
) -> None:
    with start(tmp_path, mode, etcd_single.url("flood")) as proc:
        assert proc.proc is not None
        big = ws_frame(renewal("x" * 64_000, "e", [0]))  # about 64 KB, refused (422) each
        ws = RawStream(proc.port)
        assert ws.status == 101
        for _ in range(64):  # the registry warmed up: each answered before the next is sent
            ws.sock.sendall(big)
            assert ws.frame()[0] == 0x1
        pid, base = proc.proc.pid, vm_rss_kib(proc.proc.pid)
        stop = threading.Event()
        ws.sock.settimeout(10)
        reader = drain(ws.sock, stop)
        grew, sent, started = 0.0, 0, time.monotonic()
        try:
            for sent in range(1, 4097):  # 256 MiB at most, 20 s at most
                ws.sock.sendall(big)
                if sent % 64 == 0:
                    grew = growth_mib(pid, base)
                    if grew > FRAME_BOUND_MIB or time.monotonic() - started > 20:
                        break
            grew = max(grew, growth_mib(pid, base))
        finally:
            stop.set()
            reader.join(timeout=5)
            ws.close()
        assert grew <= FRAME_BOUND_MIB, (
            f"{sent} renewals of 64 KB: the registry grew {grew:.0f} MiB"
        )


# -- 3. one flooding stream, another client -------------------------------------------------


def test_a_flooding_stream_leaves_other_clients_served(tmp_path: Path, mode: str) -> None:
    with start(tmp_path, mode) as proc, httpx.Client(base_url=proc.url, timeout=30) as api:
        engine_id = launch(api, "flood", 2)
        other = launch(api, "other", 1)
        block = ws_frame(renewal("flood", engine_id, [0, 1])) * 4096
        ws = RawStream(proc.port, timeout_s=10)
        assert ws.status == 101
        stop = threading.Event()
        reader = drain(ws.sock, stop)

        def flood() -> None:
            deadline = time.monotonic() + 8
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    ws.sock.sendall(block)
                except OSError:
                    return

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        took: list[float] = []
        try:
            time.sleep(0.5)  # the flood under way
            until = time.monotonic() + 4
            while time.monotonic() < until:
                t0 = time.monotonic()
                beat = api.post(
                    "/tp-groups/other/engine/agents/heartbeat",
                    json={"engine_id": other, "ranks": [0]},
                )
                took.append(time.monotonic() - t0)
                assert beat.status_code == 200, beat.text
                time.sleep(0.02)
        finally:
            stop.set()
            flooder.join(timeout=10)
            reader.join(timeout=5)
            ws.close()
        worst = max(took)
        fair = worst < 1.0 and len(took) >= 20
        assert fair, (
            f"{len(took)} heartbeats in 4 s beside the flood, the slowest {worst:.2f} s "
            "(want at least 20, each within 1 s)"
        )


# -- 4. a stream whose client stops reading ----------------------------------------------------


DEADLINES = {  # the idle deadline (2 s), or the ping's (a ping a second, 1 s for its pong)
    "idle": {"REGISTRY_KEEPALIVE_IDLE_S": "2"},
    "ping": {"REGISTRY_KEEPALIVE_IDLE_S": "600", "REGISTRY_KEEPALIVE_PING_S": "1"},
}


@pytest.mark.parametrize("deadline", DEADLINES)
def test_a_stream_whose_client_reads_nothing_ends_at_its_deadline_and_frees_its_slot(
    tmp_path: Path, mode: str, deadline: str
) -> None:
    env = {"REGISTRY_KEEPALIVE_MAX": "1", **DEADLINES[deadline]}
    with start(tmp_path, mode, **env) as proc, httpx.Client(base_url=proc.url, timeout=30) as api:
        ranks = list(range(32))
        engine_id = launch(api, "g", len(ranks))
        frame = ws_frame(renewal("g", engine_id, ranks))  # answered with about 2 KB
        ws = RawStream(proc.port, rcvbuf=4096)
        assert ws.status == 101
        ws.sock.settimeout(0.5)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 5:  # until the server stops reading, or ends it
                ws.sock.sendall(frame * 64)
        except OSError:  # TimeoutError: it reads no more; a reset: it ended the stream
            pass
        stalled = time.monotonic()
        statuses: list[int] = []
        try:
            while time.monotonic() - stalled < 12:
                other = RawStream(proc.port)
                other.close()
                statuses.append(other.status)
                if other.status == 101:
                    break
                time.sleep(0.5)
        finally:
            ws.close()
        waited = time.monotonic() - stalled
        assert statuses[-1] == 101, (
            f"the slot still held {waited:.0f} s after the client stopped reading "
            f"({deadline} deadline 2 s): upgrades answered {statuses}"
        )


# -- 5. text frames that are not UTF-8 ----------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [json.dumps(["g", "e", [0]]).encode("utf-16"), b'["g\xc3(", "e", [0]]'],
    ids=["utf-16", "invalid-utf-8"],
)
def test_a_text_frame_that_is_not_utf8_closes_the_stream_with_1007(
    tmp_path: Path, mode: str, payload: bytes
) -> None:
    with start(tmp_path, mode) as proc:
        ws = RawStream(proc.port)
        try:
            assert ws.status == 101
            ws.sock.sendall(ws_frame(payload))
            assert ws.close_code() == 1007
        finally:
            ws.close()
        again = RawStream(proc.port)
        again.close()
        assert again.status == 101


# -- bodies over the limit on the hot routes -------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_on_a_hot_route_answers_413(
    tmp_path: Path, mode: str, chunked: bool
) -> None:
    with (
        start(tmp_path, mode, REGISTRY_MAX_BODY_BYTES="1024") as proc,
        httpx.Client(base_url=proc.url, timeout=10) as api,
    ):
        engine_id = launch(api, "g", 1)
        body = json.dumps({"engine_id": engine_id, "ranks": [0], "pad": "x" * 4096}).encode()
        content = iter([body[:1000], body[1000:]]) if chunked else body
        for path in ("/tp-groups/g/engine/agents/heartbeat", "/tp-groups/g/engine/agents/0"):
            answer = api.request("POST" if "heartbeat" in path else "PUT", path, content=content)
            assert answer.status_code == 413, (path, answer.text)
            assert answer.json()["code"] == "payload_too_large"
            content = iter([body[:1000], body[1000:]]) if chunked else body
        assert api.get("/tp-groups/g/engine").status_code == 200


# -- frame sizes, kinds and compression -----------------------------------------------------


def test_frames_of_every_kind_answer_alike_and_an_oversized_one_closes_1009(
    tmp_path: Path, mode: str
) -> None:
    with start(tmp_path, mode) as proc, httpx.Client(base_url=proc.url, timeout=30) as api:
        engine_id = launch(api, "g", 2)
        message = renewal("g", engine_id, [0, 1])
        ws = RawStream(proc.port)
        try:
            assert ws.status == 101
            half = len(message) // 2
            frames = [
                ws_frame(message),  # text
                ws_frame(message, opcode=0x2),  # binary: the same renewal
                bytes((0x01, 0x80 | half))
                + b"\0\0\0\0"
                + message[:half]  # fragmented
                + ws_frame(message[half:], opcode=0x0),
                ws_frame(b"x" * 100, opcode=0x9),  # a ping: its pong
                ws_frame(message),
            ]
            ws.sock.sendall(b"".join(frames))
            got = [ws.frame() for _ in range(5)]  # the pong may come before the answers
            assert [p for op, p in got if op == 0xA] == [b"x" * 100], got
            answers = [json.loads(p) for op, p in got if op == 0x1]
            assert [[a["rank"] for a in x["agents"]] for x in answers] == [[0, 1]] * 4, got
            ws.sock.sendall(ws_frame(b"[" + b" " * 65_536 + b"]"))  # past 65,535 bytes
            assert ws.close_code() == 1009
        finally:
            ws.close()
        url = proc.url.replace("http://", "ws://") + "/keepalive"
        with connect(url, open_timeout=5, proxy=None, compression="deflate") as deflated:
            deflated.send(message.decode())
            assert [a["rank"] for a in json.loads(deflated.recv(timeout=10))["agents"]] == [0, 1]
