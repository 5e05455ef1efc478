"""Ceiling servers under the registry's own uvicorn settings: ``python -m bench.minimal KIND PORT``.

- ``fastapi``: a minimal FastAPI app (``GET /ping``, ``PUT /agents/{rank}`` with a pydantic body
  like an agent registration), the framework's ceiling: what any FastAPI service answers on
  this machine before it does any work.
- ``raw``: a bare ASGI callable answering a fixed body, to find the load client's own ceiling.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

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
            "headers": [(b"content-type", b"application/json")],
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


def uvicorn_options() -> dict[str, Any]:
    """The registry's own server settings (app/server.py), so ceilings run under them."""
    from app.server import uvicorn_options as registry_options
    from app.settings import Settings

    return registry_options(Settings())


def main(argv: list[str]) -> int:
    import uvicorn

    kind, port = argv[0], int(argv[1])
    app = raw_app if kind == "raw" else fastapi_app()
    uvicorn.run(app, host="127.0.0.1", port=port, **uvicorn_options())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
