"""The PD request, as vLLM's `toy_proxy_server.py` sends it, with a deadline (and as
MooncakeConnector takes it: `mooncake_pd_complete`).

Prefill gets the request with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode:
true}`; decode gets the original request with the `kv_transfer_params` prefill answered, and
pulls the prompt's KV over NIXL. Both calls share one deadline: a PD request that does not
finish in time raises `PDTimeout` naming the stage that was waiting and, when the caller
says where decode logs, decode's last log lines (a decode that waits forever on a KV
transfer answers nothing itself).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from workers.vllm_plugin.kv_watch import MARK as KV_WATCH_MARK

PD_TIMEOUT_S = 90.0
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's API server sends the request to this DP rank


class PDTimeout(TimeoutError):
    """A PD request that did not finish within its deadline."""


def _post(
    http: httpx.Client,
    url: str,
    body: Mapping[str, Any],
    deadline: float,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.ReadTimeout(f"no time left for {url}")
    return http.post(url, json=dict(body), headers=dict(headers or {}), timeout=httpx.Timeout(left))


def pd_complete(
    prefill_url: str,
    decode_url: str,
    body: Mapping[str, Any],
    *,
    timeout_s: float = PD_TIMEOUT_S,
    decode_logs: Callable[[], str] | None = None,
    side_channel_port: int | None = None,
    dp_rank: int | None = None,
) -> tuple[httpx.Response, dict[str, Any]]:
    """Prefill (max_tokens 1, do_remote_decode), then decode with prefill's kv_transfer_params.

    Returns decode's response and the kv_transfer_params prefill handed over. Raises
    `PDTimeout` when the two together take longer than `timeout_s`. ``side_channel_port``
    replaces the prefill's side-channel port in what decode gets (a closed port proves which
    way decode's handshake went). ``dp_rank`` hands the prefill to that data-parallel rank
    of a DP instance (vLLM's `X-data-parallel-rank` header); decode pulls from the engine the
    answer names (`remote_engine_id`: the rank's engine_id, `remote_port`: its side channel).
    """
    prefill_body = dict(body)
    prefill_body.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    prefill_body.pop("stream_options", None)
    deadline = time.monotonic() + timeout_s
    stage = f"prefill {prefill_url}"
    try:
        with httpx.Client(trust_env=False) as http:
            to_rank = {} if dp_rank is None else {DP_RANK_HEADER: str(dp_rank)}
            first = _post(http, f"{prefill_url}/v1/completions", prefill_body, deadline, to_rank)
            first.raise_for_status()
            params = dict(first.json().get("kv_transfer_params") or {})
            if side_channel_port is not None:
                params["remote_port"] = side_channel_port
            decode_body = dict(body)
            decode_body["kv_transfer_params"] = params
            stage = f"decode {decode_url} (pulling KV from engine {params.get('remote_engine_id')})"
            return _post(http, f"{decode_url}/v1/completions", decode_body, deadline), params
    except httpx.TimeoutException as exc:
        log = decode_logs() if decode_logs is not None else "(decode's log not given)"
        raise PDTimeout(
            f"PD request did not finish within {timeout_s:.0f} s: {stage} had not answered "
            f"({type(exc).__name__}).\n{nixl_state(prefill_url, decode_url, log)}\n"
            f"Decode's last log lines:\n{log[-3000:]}"
        ) from exc


def mooncake_pd_complete(
    prefill_url: str,
    decode_url: str,
    body: Mapping[str, Any],
    *,
    engine_id: str,
    bootstrap_addr: str,
    timeout_s: float = PD_TIMEOUT_S,
    decode_logs: Callable[[], str] | None = None,
) -> httpx.Response:
    """The PD request as vLLM's MooncakeConnector takes it: the router names the transfer
    (``transfer_id``) and the prefill engine up front (``engine_id``, the registry's, and
    ``bootstrap_addr``, where decode asks for its workers); prefill (max_tokens 1) keeps the
    prompt's KV until decode pulls it through Mooncake's transfer engine. Decode's answer;
    `PDTimeout` past ``timeout_s``."""
    transfer = {"transfer_id": f"xfer-{uuid.uuid4().hex}"}
    prefill_body = {**body, "max_tokens": 1, "stream": False}
    prefill_body["kv_transfer_params"] = {"do_remote_decode": True, **transfer}
    decode_body = dict(body)
    decode_body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_addr,
        **transfer,
    }
    deadline = time.monotonic() + timeout_s
    stage = f"prefill {prefill_url}"
    try:
        with httpx.Client(trust_env=False) as http:
            _post(http, f"{prefill_url}/v1/completions", prefill_body, deadline).raise_for_status()
            stage = f"decode {decode_url} (pulling KV from engine {engine_id} over Mooncake)"
            return _post(http, f"{decode_url}/v1/completions", decode_body, deadline)
    except httpx.TimeoutException as exc:
        log = decode_logs() if decode_logs is not None else "(decode's log not given)"
        raise PDTimeout(
            f"PD request did not finish within {timeout_s:.0f} s: {stage} had not answered "
            f"({type(exc).__name__}).\nDecode's last log lines:\n{log[-3000:]}"
        ) from exc


def complete(url: str, body: Mapping[str, Any], *, timeout_s: float = 120.0) -> httpx.Response:
    with httpx.Client(timeout=timeout_s, trust_env=False) as http:
        return http.post(f"{url}/v1/completions", json=dict(body))


def nixl_counters(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """An instance's NIXL counters from its `/metrics` (`vllm:nixl_*` counts and totals,
    summed over label sets): transfers done, failed, blocks expired, notifications failed."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:nixl_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_count", "_total")):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def nixl_transfers(decode_url: str, timeout_s: float = 60.0) -> float:
    """Decode's `vllm:nixl_xfer_time_seconds_count` (0 when absent). A generous deadline: on a
    2-core machine decode's API server shares its cores with spinning vLLM workers (an idle
    CPU decode worker spins at ~95% of its core) and answered /metrics after more than 10 s."""
    return nixl_counters(decode_url, timeout_s).get("vllm:nixl_xfer_time_seconds_count", 0.0)


def nixl_state(prefill_url: str, decode_url: str, decode_log: str) -> str:
    """What a stuck PD request's NIXL side looked like: decode worker's KV-pull watch lines
    (the stage: handshake pending, READ posted, not posted) and both sides' NIXL counters."""
    watch = [line for line in decode_log.splitlines() if KV_WATCH_MARK in line][-6:]
    lines = ["decode's KV-pull watch (workers.vllm_plugin.kv_watch):"]
    lines += watch or ["  (no line: decode's worker did not poll its transfers, or no plugin)"]
    for side, url in (("decode", decode_url), ("prefill", prefill_url)):
        try:
            counters = nixl_counters(url, timeout_s=5.0)
            shown = ", ".join(f"{k.removeprefix('vllm:nixl_')}={v:g}" for k, v in counters.items())
        except httpx.HTTPError as exc:
            shown = f"/metrics unanswered ({type(exc).__name__})"
        lines.append(f"{side} NIXL counters: {shown or 'none'}")
    return "\n".join(lines)


class Proxy:
    """A tiny HTTP proxy: POST /v1/completions through prefill, then decode.

    A PD request past its deadline answers 504 with decode's last log lines.
    """

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        port: int | None = None,
        *,
        decode_logs: Callable[[], str] | None = None,
        timeout_s: float = PD_TIMEOUT_S,
    ):
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                if self.path != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                try:
                    answer, _ = pd_complete(
                        outer.prefill_url,
                        outer.decode_url,
                        body,
                        timeout_s=timeout_s,
                        decode_logs=decode_logs,
                    )
                    status, payload = answer.status_code, answer.content
                except PDTimeout as exc:
                    status, payload = 504, json.dumps({"error": str(exc)}).encode()
                except httpx.HTTPError as exc:
                    status, payload = 502, json.dumps({"error": str(exc)}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.port = int(self.server.server_port)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
