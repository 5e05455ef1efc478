"""Handshake: a decode rank resolving a prefill engine and loading its NIXL agents.

A prefill group of TP 8 runs in its own process (``bench.nixl_peer prefill``): eight real NIXL
agents (UCX, registered DRAM) whose real metadata is registered with a real registry process
on SQLite. This process is the decode rank, with its own NIXL agent. For decode TP 1, 2, 4 and
8, each iteration (ranks taken in turn):

- **registry time**: ``POST /engines/{id}/handshake`` over a kept-alive HTTP connection, the
  answer parsed and every target's blob decoded (what a client does before it can load);
- **NIXL time**: ``add_remote_agent`` for every target (``remove_remote_agent`` afterwards, not
  timed, so the next iteration loads afresh).

Decode TP 1 loads all eight prefill agents; decode TP 8 loads one each.
"""

from __future__ import annotations

import base64
import http.client
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import peer, registry_server, say, summary_ms

PREFILL_TP = 8
DECODE_TPS = (1, 2, 4, 8)


def _decode_agent() -> Any:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-decode", nixl_agent_config(backends=["UCX"]))
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    agent.register_memory(memory)
    return agent, memory


def _measure(
    conn: http.client.HTTPConnection, agent: Any, engine_id: str, tp: int, iterations: int
) -> dict[str, Any]:
    registry: list[float] = []
    nixl: list[float] = []
    total: list[float] = []
    for i in range(iterations):
        rank = i % tp
        body = json.dumps({"tp_size": tp, "rank": rank})
        t0 = time.perf_counter()
        conn.request(
            "POST",
            f"/engines/{engine_id}/handshake",
            body=body,
            headers={"content-type": "application/json"},
        )
        answer = conn.getresponse()
        raw = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"handshake answered {answer.status}: {raw[:300]!r}")
        plan = json.loads(raw)
        blobs = [base64.b64decode(t["agent_metadata"]) for t in plan["targets"]]
        t1 = time.perf_counter()
        names = [agent.add_remote_agent(b) for b in blobs]
        t2 = time.perf_counter()
        for name in names:
            agent.remove_remote_agent(name.decode() if isinstance(name, bytes) else name)
        registry.append(t1 - t0)
        nixl.append(t2 - t1)
        total.append(t2 - t0)
    return {
        "decode_tp": tp,
        "targets_per_rank": max(1, PREFILL_TP // tp),
        "registry": summary_ms(registry),
        "nixl": summary_ms(nixl),
        "total": summary_ms(total),
    }


def run(quick: bool = False) -> dict[str, Any]:
    iterations = 20 if quick else 200
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-handshake-") as name:
        tmp = Path(name)
        with registry_server(f"sqlite:///{tmp}/hs.db", log=tmp / "registry.log") as url:
            say(f"  prefill TP {PREFILL_TP}: starting real NIXL agents in a peer process")
            with peer(["prefill", url, "prefill-0", str(PREFILL_TP)]) as ready:
                agent, _memory = _decode_agent()
                host, port = url.removeprefix("http://").rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    _measure(conn, agent, ready["engine_id"], 8, 5)  # warm-up
                    for tp in DECODE_TPS:
                        say(f"  decode TP {tp} x {iterations} handshakes")
                        row = _measure(conn, agent, ready["engine_id"], tp, iterations)
                        say(
                            f"    registry p50 {row['registry']['p50_ms']} ms, "
                            f"NIXL p50 {row['nixl']['p50_ms']} ms"
                        )
                        rows.append(row)
                finally:
                    conn.close()
                    del agent
    return {
        "prefill_tp": PREFILL_TP,
        "metadata_bytes": ready["metadata_bytes"],
        "iterations": iterations,
        "rows": rows,
    }
