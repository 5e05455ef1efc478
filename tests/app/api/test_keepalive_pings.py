"""``GET /keepalive``: the server's keep-alive pings (``REGISTRY_KEEPALIVE_PING_S``, here 2 s)
go only to a quiet stream; a stream that renews within the interval gets none (its renewals
show it alive).

Two streams on one real registry, read frame by frame over raw sockets (a client library
would answer the pings unseen): one renews every 0.4 s, one says nothing; after 2.6 s only
the quiet one has been pinged.
"""

from __future__ import annotations

import base64
import json
import os
import select
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body, new_gid, sqlite_url

pytestmark = [pytest.mark.api, pytest.mark.timeout(120)]

PING_S = 2.0  # REGISTRY_KEEPALIVE_PING_S for the test's registry (20 s by default)
TEXT, PING = 0x81, 0x89


class RawStream:
    """A WebSocket client over a plain socket: it sees every frame the server sends."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /keepalive HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv(10.0)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self.opcodes: list[int] = []

    def _recv(self, timeout_s: float) -> bytes:
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            return b""
        data = self.sock.recv(65_536)
        assert data, "the registry closed the stream"
        return data

    def send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        assert len(payload) < 126
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes((TEXT, 0x80 | len(payload))) + mask + masked)

    def read(self, timeout_s: float) -> bytes | None:
        """Frames read within ``timeout_s`` noted in ``opcodes``; the first text frame's
        payload, if one came."""
        deadline = time.monotonic() + timeout_s
        while True:
            while len(self.buf) >= 2:
                length, head = self.buf[1] & 0x7F, 2
                if length == 126:
                    length, head = int.from_bytes(self.buf[2:4], "big"), 4
                if len(self.buf) < head + length:
                    break
                opcode, payload = self.buf[0], self.buf[head : head + length]
                self.buf = self.buf[head + length :]
                self.opcodes.append(opcode)
                if opcode == TEXT:
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.buf += self._recv(left)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RegistryProcess]:
    env = {"REGISTRY_KEEPALIVE_PING_S": str(PING_S)}
    with RegistryProcess(sqlite_url(tmp_path), env=env, log_path=tmp_path / "registry.log") as proc:
        yield proc


def test_a_renewing_stream_is_not_pinged_and_a_quiet_one_is(server: RegistryProcess) -> None:
    group = new_gid("ka-ping")
    with httpx.Client(base_url=server.url, timeout=30.0) as api:
        body = {"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": "prefill"}
        opened = api.put(f"/tp-groups/{group}/engine", json=body)
        assert opened.status_code in (200, 201), opened.text
        engine_id = opened.json()["engine_id"]
        agents = {"agents": [agent_body(engine_id, 0) | {"rank": 0}]}
        assert api.put(f"/tp-groups/{group}/engine/agents", json=agents).status_code == 200
    renewing, quiet = RawStream(server.url), RawStream(server.url)
    try:
        message = json.dumps([group, engine_id, [0]])
        started = time.monotonic()
        while time.monotonic() - started < PING_S * 1.3:  # past the first ping's time
            renewing.send(message)
            answer = renewing.read(10.0)
            assert answer is not None
            assert b'"agents"' in answer, answer
            quiet.read(PING_S / 5)  # the renewals' pace: five an interval
        renewing.read(0.5)
        assert PING not in renewing.opcodes, renewing.opcodes
        # The quiet one's ping is due since PING_S; under load it may come a little late.
        deadline = time.monotonic() + PING_S
        while PING not in quiet.opcodes and time.monotonic() < deadline:
            quiet.read(0.1)
        assert PING in quiet.opcodes, quiet.opcodes
    finally:
        renewing.close()
        quiet.close()
