"""Ceiling servers under the registry's own uvicorn settings: ``python -m bench.minimal KIND PORT``.

- ``fastapi``: a minimal FastAPI app (``GET /ping``, ``PUT /agents/{rank}`` with a pydantic body
  like an agent registration), the framework's ceiling: what any FastAPI service answers on
  this machine before it does any work.
- ``raw``: a bare ASGI callable answering a fixed body, to find the load client's own ceiling.
- ``protocol``: no uvicorn and no ASGI: an asyncio protocol on uvloop parsing requests with
  httptools (what uvicorn parses with) and answering a fixed body in one write; what the
  registry's hot routes answered in the protocol (app/server/bypass/wire.py) cost at least.
- ``routes``: the framework's floor for the launch storm of ``bench.storm_lean``: the
  registry's four storm routes with its own request models (``app.core.schemas``), answering
  fixed bodies of the registry's shape, with no storage and no logic.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, cast

from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

# At module level: FastAPI resolves the routes' (string) annotations in this namespace.
from app.core.schemas import EngineIdBody, HandshakeRequest, OpenEngineRequest, RegisterAgentRequest

PING = b'{"ok":true}'


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(PING)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": PING})


class Body(BaseModel):
    engine_id: str
    agent_name: str
    agent_metadata: str
    host: str
    kv: dict[str, Any]
    ttl_s: int = 30


class Answer(BaseModel):
    rank: int
    agent_name: str


def fastapi_app() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.put("/agents/{rank}", response_model=Answer, status_code=201)
    async def put_agent(rank: int, body: Body) -> Answer:
        return Answer(rank=rank, agent_name=body.agent_name)

    return app


def routes_app() -> Any:
    import base64
    import uuid

    from fastapi import FastAPI

    app = FastAPI()
    blob = base64.b64encode(bytes(4096)).decode()

    def engine(group_id: str) -> dict[str, Any]:
        return {
            "group_id": group_id,
            "engine_id": str(uuid.uuid5(uuid.NAMESPACE_URL, group_id)),
            "generation": 1,
            "tp_size": 8,
            "ready": False,
        }

    @app.put("/tp-groups/{group_id}/engine", status_code=201)
    async def open_engine(group_id: str, body: OpenEngineRequest) -> dict[str, Any]:
        return engine(group_id) | {"launch_id": body.launch_id, "role": body.role}

    @app.get("/tp-groups/{group_id}/engine")
    async def get_engine(group_id: str) -> dict[str, Any]:
        return engine(group_id)

    @app.put("/tp-groups/{group_id}/engine/agents/{rank}", status_code=201)
    async def register(group_id: str, rank: int, body: RegisterAgentRequest) -> dict[str, Any]:
        return {
            "engine_id": body.engine_id,
            "rank": rank,
            "agent_name": body.agent_name,
            "host": body.host,
            "ttl_s": body.ttl_s,
        }

    @app.post("/tp-groups/{group_id}/engine/agents/{rank}/heartbeat")
    async def heartbeat(group_id: str, rank: int, body: EngineIdBody) -> dict[str, Any]:
        return {"expires_at": ""}

    @app.post("/engines/{engine_id}/handshake")
    async def handshake(engine_id: str, body: HandshakeRequest) -> dict[str, Any]:
        target = {
            "rank": body.rank,
            "agent_name": "a",
            "agent_metadata": blob,
            "host": "h",
            "kv": {},
            "expires_at": "",
        }
        return {"engine_id": engine_id, "targets": [target]}

    return app


def uvicorn_options() -> dict[str, Any]:
    """The registry's own server settings (app/server/serve.py), so ceilings run under them."""
    from app.server.serve import uvicorn_options as registry_options
    from app.server.settings import Settings

    return registry_options(Settings())


def serve_protocol(port: int) -> None:
    import asyncio

    import httptools
    import uvloop

    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(PING), PING)
    )

    class Fixed(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            self.transport.write(answer)

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(
            Fixed, "127.0.0.1", port, backlog=4096
        )
        await server.serve_forever()

    uvloop.run(run())


def main(argv: list[str]) -> int:
    import uvicorn

    from app.server.serve import GC_THRESHOLD

    kind, port = argv[0], int(argv[1])
    if kind == "protocol":
        gc.set_threshold(*GC_THRESHOLD)
        serve_protocol(port)
        return 0
    app = {"raw": lambda: raw_app, "fastapi": fastapi_app, "routes": routes_app}[kind]()
    gc.set_threshold(*GC_THRESHOLD)  # the registry's own process setting (app/server/serve.py)
    uvicorn.run(app, host="127.0.0.1", port=port, **uvicorn_options())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
