"""CPU per request of each hot route inside the process, without HTTP: the app is called as
an ASGI callable in a loop, so what is measured is the registry's own work plus FastAPI's,
against a minimal FastAPI route called the same way. Figures are process CPU time
(``time.process_time``), the measure least disturbed by other processes on a shared machine.

``python -m bench.asgi_cost [--profile OUT]`` (``--profile`` writes a cProfile of the
registry routes, sorted by cumulative time, to OUT).
"""

from __future__ import annotations

import asyncio
import base64
import cProfile
import io
import json
import logging
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message

N = 3000
PROFILES: list[str] = []
TP = 8
BLOB = 4096

Call = Callable[[], Awaitable[int]]


def caller(app: ASGIApp, method: str, path: str, body: Any = None, query: str = "") -> Call:
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(b"host", b"bench"), (b"content-length", str(len(raw)).encode())]
    if body is not None:
        headers.append((b"content-type", b"application/json"))

    async def call() -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": list(headers),
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080),
        }
        status = 0
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    return call


async def cost(call: Call, n: int = N, rounds: int = 5) -> float:
    """CPU microseconds per call after a warm-up: the best of ``rounds`` rounds (other
    processes on a shared machine only ever add to a round's figure)."""
    for _ in range(200):
        status = await call()
        if status >= 400:
            raise RuntimeError(f"status {status}")
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(n // rounds):
            await call()
        best = min(best, (time.process_time() - start) / (n // rounds) * 1e6)
    return best


async def registry_calls(app: Any) -> dict[str, Call]:
    put = caller(
        app, "PUT", "/tp-groups/p0/engine", {"launch_id": "l1", "tp_size": TP, "role": "prefill"}
    )
    assert await put() in (200, 201)
    get = caller(app, "GET", "/tp-groups/p0/engine")
    eid = await _engine_id(app)
    agents = []
    for rank in range(TP):
        agent = {
            "engine_id": eid,
            "agent_name": f"a{rank}",
            "agent_metadata": base64.b64encode(bytes([rank]) * BLOB).decode(),
            "host": "127.0.0.1",
            "kv": {
                "mem_type": "DRAM",
                "device_id": 0,
                "base_addrs": [1],
                "num_blocks": 1,
                "block_len": 1,
            },
            "ttl_s": 3600,
        }
        assert await caller(app, "PUT", f"/tp-groups/p0/engine/agents/{rank}", agent)() < 300
        agents.append(agent)
    return {
        "open": put,  # the same launch again: answered from the engine it opened
        "register": caller(app, "PUT", "/tp-groups/p0/engine/agents/3", agents[3]),
        "get_engine": get,
        "handshake": caller(app, "POST", f"/engines/{eid}/handshake", {"tp_size": TP, "rank": 3}),
        "heartbeat": caller(
            app, "POST", "/tp-groups/p0/engine/agents/3/heartbeat", {"engine_id": eid}
        ),
    }


async def _engine_id(app: Any) -> str:
    body: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/tp-groups/p0/engine",
        "raw_path": b"",
        "query_string": b"",
        "headers": [],
        "root_path": "",
        "scheme": "http",
        "http_version": "1.1",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "asgi": {"version": "3.0"},
    }
    await app(scope, receive, send)
    return str(json.loads(b"".join(body))["engine_id"])


async def main(profile: str | None) -> dict[str, float]:
    from app.core import logs
    from app.main import create_app
    from app.server.settings import Settings
    from bench.minimal import fastapi_app, routes_app

    # Logging as the service configures it (one JSON line per request), written nowhere.
    logs.configure("info")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(open(os.devnull, "w"))  # noqa: SIM115, ASYNC230
    out: dict[str, float] = {}
    floor = fastapi_app()
    out["fastapi_get_us"] = await cost(caller(floor, "GET", "/ping"))
    # The storm's routes with the same request models and no work (bench.minimal routes).
    routes = routes_app()
    for name, call in (await registry_calls(routes)).items():
        out[f"floor_{name}_us"] = await cost(call)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(store=f"sqlite:///{Path(tmp) / 'cost.db'}")
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            calls = await registry_calls(app)
            prof = cProfile.Profile() if profile else None
            for name, call in calls.items():
                if prof is not None:
                    prof.enable()
                out[f"{name}_us"] = await cost(call)
                if prof is not None:
                    prof.disable()
            if prof is not None and profile is not None:
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
                PROFILES.append(text.getvalue())
    for name in ("open", "register", "get_engine", "handshake"):
        out[f"{name}_vs_floor"] = round(out[f"floor_{name}_us"] / out[f"{name}_us"], 2)
    for name in ("get_engine", "handshake", "heartbeat"):
        out[f"{name}_vs_fastapi_get"] = round(out["fastapi_get_us"] / out[f"{name}_us"], 2)
    return {k: round(v, 1) if k.endswith("_us") else v for k, v in out.items()}


if __name__ == "__main__":
    target = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
    print(json.dumps(asyncio.run(main(target)), indent=1))
    if target is not None:
        Path(target).write_text("".join(PROFILES))
