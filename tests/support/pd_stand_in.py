"""Stand-ins for vLLM instances behind a router (named so: the real ones run in the vLLM
tier): aiohttp servers on loopback answering what a PD router asks of a vLLM OpenAI server.
A prefill stand-in answers ``kv_transfer_params`` naming its engine; a decode stand-in
answers text naming the prefill engine it was handed. Each records the requests it got."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from workers.tools.procs import free_port


@dataclass
class StandIn:
    name: str
    kind: str  # "prefill" or "decode"
    engine_id: str = ""
    port: int = field(default_factory=free_port)
    completions: list[dict[str, Any]] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def since(self, t: float) -> int:
        """Completions it got after monotonic time ``t``."""
        return sum(stamp > t for stamp in self.stamps)

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/v1/completions":
            body = await request.json()
            self.completions.append(body)
            self.stamps.append(time.monotonic())
            if self.kind == "prefill":
                params = {
                    "do_remote_prefill": True,
                    "remote_engine_id": self.engine_id,
                    "remote_block_ids": [0],
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                }
                return web.json_response(
                    {"id": "p", "choices": [{"text": "", "index": 0}], "kv_transfer_params": params}
                )
            handed = (body.get("kv_transfer_params") or {}).get("remote_engine_id")
            text = f"{self.name} decoded from {handed}"
            return web.json_response({"id": "d", "choices": [{"text": text, "index": 0}]})
        return web.json_response({"object": "list", "data": [{"id": "m"}]})


class StandIns:
    """Servers on one event loop in a thread; ``add`` starts one, ``remove`` stops it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: dict[str, web.AppRunner] = {}

    def add(self, name: str, kind: str, engine_id: str = "") -> StandIn:
        instance = StandIn(name, kind, engine_id)

        async def start() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", instance.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", instance.port).start()
            self.runners[name] = runner

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return instance

    def remove(self, name: str) -> None:
        runner = self.runners.pop(name)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)

    def close(self) -> None:
        for name in list(self.runners):
            self.remove(name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
