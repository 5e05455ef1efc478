"""``GET /keepalive``: a renewing stream outlives the HTTP keep-alive timer of the connection
it was upgraded from (``REGISTRY_KEEP_ALIVE_S``).

The HTTP protocol's watchdog (``app/server/protocol.py``, ``GuardedProtocol._tick``) is disarmed
when uvicorn hands the connection to the WebSocket protocol; before, it found no request cycle
(idle) and closed the transport, without a close frame, at its first tick past
``REGISTRY_KEEP_ALIVE_S`` after the upgrade (75 s by default): every node's stream broke about
every 80 s, and the node renewed over REST and opened it again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from websockets.sync.client import connect

from harness.server import RegistryProcess
from tests.app.api.conftest import sqlite_url

pytestmark = [pytest.mark.api, pytest.mark.timeout(60)]


def test_a_renewing_stream_outlives_the_http_keep_alive_timer(tmp_path: Path) -> None:
    env = {
        "REGISTRY_KEEP_ALIVE_S": "2",
        "REGISTRY_HEADER_TIMEOUT_S": "1",  # the watchdog's period: min(header, body) timeouts
        "REGISTRY_BODY_TIMEOUT_S": "1",
    }
    with RegistryProcess(sqlite_url(tmp_path), env=env, log_path=tmp_path / "log") as server:
        url = server.url.replace("http://", "ws://") + "/keepalive"
        with connect(url, open_timeout=5, proxy=None) as ws:
            started = time.monotonic()
            while time.monotonic() - started < 6:  # three keep-alive timers
                ws.send("[]")  # refused (422), but a message: the stream is in use
                assert b'"status":422' in ws.recv(timeout=5, decode=False)
                time.sleep(0.5)
