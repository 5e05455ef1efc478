"""The PD request's deadline, against scripted prefill/decode HTTP servers (no vLLM).

A decode that never answers (as one waiting forever on a KV transfer) must fail the request
within the bound, with decode's last log lines, and the launcher's proxy must answer 504. The
Mooncake PD request (the gpu tier's) names one transfer to both sides.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from workers.tools.vllm_pd import PDTimeout, Proxy, mooncake_pd_complete, pd_complete
from workers.vllm_plugin.kv_watch import MARK as KV_WATCH_MARK

pytestmark = pytest.mark.unit

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [1], "remote_port": 1}
BODIES: dict[int, list[dict[str, Any]]] = {}  # what each server (by port) was sent


class _Scripted(BaseHTTPRequestHandler):
    delay_s = 0.0
    release = threading.Event()

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:  # /metrics, as vLLM exports NIXL's counters
        body = (
            b'vllm:nixl_xfer_time_seconds_count{engine="0"} 3.0\n'
            b'vllm:nixl_num_kv_expired_reqs_total{engine="0"} 1.0\n'
            b"vllm:nixl_xfer_time_seconds_sum 0.5\n"
        )
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        sent = self.rfile.read(int(self.headers.get("content-length", 0)))
        BODIES.setdefault(self.server.server_port, []).append(json.loads(sent))
        self.release.wait(self.delay_s)
        body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(delay_s: float, release: threading.Event) -> ThreadingHTTPServer:
    handler = type("H", (_Scripted,), {"delay_s": delay_s, "release": release})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers() -> Iterator[tuple[str, str]]:
    release = threading.Event()
    prefill, decode = _serve(0.0, release), _serve(60.0, release)  # decode never answers
    try:
        yield (
            f"http://127.0.0.1:{prefill.server_port}",
            f"http://127.0.0.1:{decode.server_port}",
        )
    finally:
        release.set()
        for server in (prefill, decode):
            server.shutdown()
            server.server_close()


def test_a_decode_that_never_answers_fails_within_the_bound_with_its_log(
    servers: tuple[str, str],
) -> None:
    prefill, decode = servers
    t0 = time.monotonic()
    watch = f"{KV_WATCH_MARK} for request r1 from engine e1 has waited 10 s: READ posted: 2"
    log = f"early line\n{watch}\ndecode: waiting for KV of e1"
    with pytest.raises(PDTimeout) as info:
        pd_complete(prefill, decode, {"prompt": "p"}, timeout_s=1.0, decode_logs=lambda: log)
    assert time.monotonic() - t0 < 5.0
    message = str(info.value)
    assert "within 1 s" in message
    assert f"decode {decode}" in message  # the stage that was waiting, and the prefill's id
    assert "engine e1" in message
    # The NIXL state: the decode worker's own stage line and both sides' counters.
    assert f"kv_watch):\n{watch}\n" in message
    for side in ("decode", "prefill"):
        assert (
            f"{side} NIXL counters: xfer_time_seconds_count=3, num_kv_expired_reqs_total=1\n"
            in message
        )
    assert message.endswith("decode: waiting for KV of e1")


def test_without_a_watch_line_the_message_says_the_worker_did_not_poll(
    servers: tuple[str, str],
) -> None:
    prefill, decode = servers
    with pytest.raises(PDTimeout) as info:
        pd_complete(prefill, decode, {"prompt": "p"}, timeout_s=1.0, decode_logs=lambda: "")
    assert "decode's worker did not poll its transfers" in str(info.value)


def test_the_proxy_answers_504_with_decodes_log(servers: tuple[str, str]) -> None:
    prefill, decode = servers
    proxy = Proxy(prefill, decode, decode_logs=lambda: "decode's tail", timeout_s=1.0).start()
    try:
        answer = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "p"}, timeout=30)
    finally:
        proxy.stop()
    assert answer.status_code == 504
    assert "decode's tail" in answer.json()["error"]


def test_a_mooncake_pd_request_names_one_transfer_and_the_prefill_engine_up_front(
    servers: tuple[str, str],
) -> None:
    prefill, decode = servers
    with pytest.raises(PDTimeout) as info:
        mooncake_pd_complete(
            prefill,
            decode,
            {"prompt": "p", "max_tokens": 8},
            engine_id="e1",
            bootstrap_addr="http://127.0.0.1:1",
            timeout_s=1.0,
            decode_logs=lambda: "decode's tail",
        )
    message = str(info.value)
    assert f"decode {decode} (pulling KV from engine e1 over Mooncake)" in message
    assert message.endswith("decode's tail")
    (to_prefill,) = BODIES[int(prefill.rsplit(":", 1)[1])]
    (to_decode,) = BODIES[int(decode.rsplit(":", 1)[1])]
    transfer = to_prefill["kv_transfer_params"]["transfer_id"]
    assert to_prefill["max_tokens"] == 1
    assert to_prefill["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": transfer}
    assert to_decode["max_tokens"] == 8
    assert to_decode["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "e1",
        "remote_bootstrap_addr": "http://127.0.0.1:1",
        "transfer_id": transfer,
    }
