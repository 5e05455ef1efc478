"""Runs in `.venv-vllm`: vLLM's own MooncakeConnector bootstrap code against a bootstrap server.

    python mooncake_driver.py

reads one step a line on stdin (JSON) and answers each with one JSON line, one vLLM import
for all: ``["register", HOST:PORT, ENGINE_ID, DP, TP, PP, ADDR]``, ``["query",
BOOTSTRAP_URL, ENGINE_ID]``, ``["own-server"]``, and with the engine-registry plugin's
Mooncake part (workers/vllm_plugin/mooncake.py): ``["plugin-register", REGISTRY_URL,
ENGINE_ID, TP, ADDR]`` (no bootstrap_server_address given: the plugin points it) and
``["plugin-query", REGISTRY_URL, ROUTER_BOOTSTRAP_URL, ENGINE_ID]``. An answer's line starts
with ``ANSWER`` (vLLM's own server logs to stdout too).

The worker objects are vLLM's `MooncakeConnectorWorker` made without its `__init__` (which
starts Mooncake's transfer engine, a GPU library); the methods called are vLLM's, unchanged:
`register_worker_with_bootstrap` (a prefill rank's POST /register),
`_connect_to_prefiller_bootstrap` and `handle_new_engine_id` (a decode's GET
{remote_bootstrap_addr}/query and what it does with the answer), and vLLM's own
`MooncakeBootstrapServer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import sys
import time
from types import SimpleNamespace
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
    MooncakeKVConnectorStats,
)

from workers.vllm_plugin import mooncake as plugin_mooncake
from workers.vllm_plugin.settings import PluginSettings


class Logged(logging.Handler):
    """vLLM's error lines, kept to show how it reacted."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOGGED = Logged()
logging.getLogger("vllm").addHandler(LOGGED)
ANSWER = "@answer "
PLUGIN: list[PluginSettings] = []  # the plugin's settings as a step gives them


def bare_worker() -> Any:
    worker = mc.MooncakeConnectorWorker.__new__(mc.MooncakeConnectorWorker)
    worker.shutdown = lambda: None  # nothing was started (its __del__ calls this)
    return worker


def kv_config(engine_id: str, extra: dict[str, Any]) -> Any:
    return KVTransferConfig(
        kv_connector="MooncakeConnector",
        kv_role="kv_producer",
        engine_id=engine_id,
        kv_connector_extra_config=extra,
    )


def prefill_worker(
    bootstrap: str | None, engine_id: str, dp: int, tp: int, pp: int, addr: str
) -> Any:
    if bootstrap is None:  # the plugin's
        config = kv_config(engine_id, {})
        plugin_mooncake.point_prefill(SimpleNamespace(kv_transfer_config=config), PLUGIN[-1])
    else:
        config = kv_config(engine_id, {"bootstrap_server_address": bootstrap})
    worker = bare_worker()
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    worker.vllm_config = SimpleNamespace(kv_transfer_config=config)
    worker.engine_id, worker.dp_rank, worker.tp_rank, worker.pp_rank = engine_id, dp, tp, pp
    worker.hostname, worker.side_channel_port = host, int(port)
    return worker


def register(
    bootstrap: str | None, engine_id: str, dp: int, tp: int, pp: int, addr: str
) -> dict[str, Any]:
    worker = prefill_worker(bootstrap, engine_id, dp, tp, pp, addr)
    pointed = dict(worker.vllm_config.kv_transfer_config.kv_connector_extra_config)
    t0 = time.monotonic()
    try:
        asyncio.run(worker.register_worker_with_bootstrap())
    except Exception as exc:  # vLLM raises: the prefill's start fails
        status = getattr(getattr(exc, "response", None), "status_code", None)
        text = getattr(getattr(exc, "response", None), "text", str(exc))
        return {
            "ok": False,
            "error": type(exc).__name__,
            "status": status,
            "text": text,
        }
    return {"ok": True, "seconds": time.monotonic() - t0, "bootstrap": pointed}


def decode_worker() -> Any:
    worker = bare_worker()
    worker._remote_agents, worker._tp_size, worker._pending_bootstrap_queries = {}, {}, {}
    worker.xfer_stats = MooncakeKVConnectorStats()
    worker._is_hma_required = False
    worker._invalid_block_ids = queue.Queue()
    worker._failed_recv_reqs = queue.Queue()
    worker.finished_recving_reqs = set()
    received: list[str] = []
    worker.receive_kv = lambda engine_id, metas: received.append(engine_id)  # the data path
    worker.received = received
    return worker


def query(bootstrap_url: str, engine_id: str, plugin: bool = False) -> dict[str, Any]:
    """A decode's first request naming ``engine_id`` at ``bootstrap_url``, through vLLM's
    `handle_new_engine_id`: found, it goes on to load the KV (``receive_kv``, the transfer,
    recorded here instead); not found, vLLM fails the request (its blocks reported invalid)."""
    worker = decode_worker()
    if plugin:
        assert plugin_mooncake.attach_decode(worker, PLUGIN[-1])
    meta = mc.PullReqMeta(
        d_req_id="req-1",
        transfer_id="xfer-1",
        local_block_ids=[[1, 2]],
        remote_engine_id=engine_id,
        remote_bootstrap_addr=bootstrap_url,
    )
    t0 = time.monotonic()
    asyncio.run(worker.handle_new_engine_id(engine_id, {"req-1": meta}))
    seconds = time.monotonic() - t0
    invalid: list[int] = []
    while not worker._invalid_block_ids.empty():
        invalid.extend(sorted(worker._invalid_block_ids.get()))
    return {
        "remote_agents": worker._remote_agents,
        "tp_size": worker._tp_size,
        "loading": worker.received,
        "failed": meta.failed,
        "invalid_blocks": invalid,
        "finished": sorted(worker.finished_recving_reqs),
        "seconds": seconds,
        "logged": LOGGED.lines,
        "asked": meta.remote_bootstrap_addr,
    }


def own_server() -> dict[str, Any]:
    """vLLM's own bootstrap server, as a shared one (``bootstrap_server_address``), across a
    relaunch: the new launch's engine id."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = MooncakeBootstrapServer("127.0.0.1", port)
    server.start()
    try:
        bootstrap = f"127.0.0.1:{port}"
        first = register(bootstrap, "prefill-a-launch-1", 0, 0, 0, "tcp://127.0.0.1:20000")
        relaunch = register(bootstrap, "prefill-a-launch-2", 0, 0, 0, "tcp://127.0.0.1:20001")
        after = query(f"http://{bootstrap}", "prefill-a-launch-2")
    finally:
        server.shutdown()
    return {"first": first, "relaunch": relaunch, "query_new": after}


def step(args: list[Any]) -> dict[str, Any]:
    LOGGED.lines = []
    if args[0] == "register":
        return register(*args[1:])
    if args[0] == "query":
        return query(*args[1:])
    if args[0] == "plugin-register":
        PLUGIN.append(PluginSettings(url=args[1], group="prefill-p"))
        return register(None, args[2], 0, args[3], 0, args[4])
    if args[0] == "plugin-query":
        PLUGIN.append(PluginSettings(url=args[1], group="decode-p"))
        return query(args[2], args[3], plugin=True)
    return own_server()


def main() -> None:
    for line in sys.stdin:
        print(ANSWER + json.dumps(step(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
