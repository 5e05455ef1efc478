"""Per-request cost of the hot routes, against the framework's own floor, in one run.

A TP 8 prefill group with 4 KiB metadata blobs is registered in a real registry (SQLite
store, default settings); then wrk (one thread, 32 connections) drives, one after another:

- ``GET /tp-groups/{g}/engine``, ``POST /engines/{id}/handshake`` (decode TP 8, rank 3: one
  target) and ``POST …/agents/{rank}/heartbeat`` on the registry;
- ``GET /ping`` on a minimal FastAPI app served the same way (``bench.minimal``, the
  registry's own server settings): the floor any FastAPI route pays;
- ``GET /ping`` on a bare ASGI app: the load client's own ceiling.

Each registry row is reported as a ratio to the minimal FastAPI GET of the same run, and
the registry's CPU per request is read from ``/proc/<pid>/stat`` around each wrk run.
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.baselines import wrk_rate
from bench.common import (
    HOST,
    cpu_seconds,
    free_port,
    process,
    registry_server,
    say,
    wait_http,
)

TP = 8
BLOB = 4096


def _prepare(url: str) -> dict[str, str]:
    with httpx.Client(base_url=url, timeout=30) as c:
        body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": "prefill"}
        engine = c.put("/tp-groups/p0/engine", json=body).raise_for_status().json()
        eid = engine["engine_id"]
        for rank in range(TP):
            agent = {
                "engine_id": eid,
                "agent_name": f"{eid}-rank{rank}",
                "agent_metadata": base64.b64encode(bytes([rank]) * BLOB).decode(),
                "host": HOST,
                "kv": {
                    "mem_type": "DRAM",
                    "device_id": 0,
                    "base_addrs": [1 << 20],
                    "num_blocks": 64,
                    "block_len": 65536,
                },
                "ttl_s": 3600,
            }
            c.put(f"/tp-groups/p0/engine/agents/{rank}", json=agent).raise_for_status()
        ready = c.get("/tp-groups/p0/engine").raise_for_status().json()
        if not ready["ready"]:
            raise RuntimeError(f"group not ready: {ready}")
    return {"engine_id": eid}


def _script(tmp: Path, name: str, method: str, body: dict[str, Any]) -> str:
    path = tmp / f"{name}.lua"
    path.write_text(
        f'wrk.method = "{method}"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
    )
    return str(path)


def _timed(pid: int, url: str, seconds: int, script: str | None = None) -> dict[str, float]:
    before = cpu_seconds(pid)
    rate = wrk_rate(url, seconds, connections=32, script=script)
    used = cpu_seconds(pid) - before
    return {"rps": rate, "server_cpu_ms": round(used / max(rate * seconds, 1) * 1000, 3)}


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 3 if quick else 6
    out: dict[str, Any] = {"tp": TP, "blob_bytes": BLOB, "wrk_connections": 32}
    with tempfile.TemporaryDirectory(prefix="bench-lookups-") as name:
        tmp = Path(name)
        for kind in ("raw", "fastapi"):
            port = free_port()
            cmd = [sys.executable, "-m", "bench.minimal", kind, str(port)]
            with process(cmd) as proc:
                base = f"http://{HOST}:{port}"
                wait_http(f"{base}/ping", 30.0, proc)
                say(f"  {kind} GET /ping")
                out[f"{kind}_get"] = _timed(proc.pid, f"{base}/ping", seconds)
        with registry_server(f"sqlite:///{tmp}/lookups.db", log=tmp / "registry.log") as url:
            eid = _prepare(url)["engine_id"]
            rows = {
                "get_engine": (f"{url}/tp-groups/p0/engine", None),
                "handshake": (
                    f"{url}/engines/{eid}/handshake",
                    _script(tmp, "hs", "POST", {"tp_size": TP, "rank": 3}),
                ),
                "heartbeat": (
                    f"{url}/tp-groups/p0/engine/agents/3/heartbeat",
                    _script(tmp, "hb", "POST", {"engine_id": eid}),
                ),
            }
            for row, (target, script) in rows.items():
                say(f"  registry {row}")
                out[row] = _timed(url.pid, target, seconds, script)
    floor = out["fastapi_get"]["rps"]
    for row in ("get_engine", "handshake", "heartbeat"):
        out[row]["vs_fastapi_get"] = round(out[row]["rps"] / floor, 2)
    return out


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(json.dumps(result, indent=1))
