"""The hot routes answered without FastAPI's per-request machinery, same contract.

Per request FastAPI routes by scanning every route's regex, solves the dependency graph and
validates each parameter through its generic machinery; that costs several times what the
registry itself does for a heartbeat or a lookup (``docs/benchmarks.md`` has the breakdown).
Workers send these few requests thousands of times a second at fleet scale:

    GET  /tp-groups/{group_id}/engine                      (no query)
    PUT  /tp-groups/{group_id}/engine                      (rank 0 opens its launch)
    PUT  /tp-groups/{group_id}/engine/agents/{rank}
    POST /tp-groups/{group_id}/engine/agents/{rank}/heartbeat
    PUT  /tp-groups/{group_id}/engine/agents               (a node's ranks, batched)
    POST /tp-groups/{group_id}/engine/agents/heartbeat     (a node's heartbeat, batched)
    POST /engines/{engine_id}/handshake

The batched pair is what the worker library sends by default (a leader per node): at
100,000 ranks, 1,250 node heartbeats a second. Each route here saves at least 20% of the
registry's CPU a request against the full stack, median of runs (``python -m bench.route_cost``,
``docs/benchmarks.md``).

This layer, inside the auth and observability middleware and in front of the body limit and
FastAPI's router, answers them when the request is valid (its body within the same limit: a
larger one goes on untouched, for the body limit to answer 413): the path parameters match
the same patterns, the body parses with the same limits (``app.server.jsonbody``) and validates
against the same pydantic request models. Anything else (a query string, a body that does
not validate, any other route) goes on to FastAPI untouched, which answers it as before:
error answers, their order, and ``/openapi.json`` (generated from the FastAPI routes, which
still declare these four) are FastAPI's. Answers are serialized by the same models; registry
errors become the same problem+json. ``REGISTRY_FAST_PATH=false`` turns the layer off.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.errors import RegistryError, at_edge
from app.core.problems import send_problem
from app.core.schemas import (
    GROUP_ID_PATTERN,
    MAX_TP_SIZE,
    EngineIdBody,
    HandshakeRequest,
    HeartbeatsRequest,
    OpenEngineRequest,
    RegisterAgentRequest,
    RegisterAgentsRequest,
)
from app.registry import Registry
from app.security.auth import check_scope
from app.server.jsonbody import M, parse, validate_json
from app.server.middleware import replay
from app.store import Unavailable

_GROUP = re.compile(GROUP_ID_PATTERN)
_JSON = [(b"content-type", b"application/json")]

# A handler's answer: status and model, or status and the model's JSON already written.
Result = tuple[int, BaseModel | bytes]
Handler = Callable[[Scope, list[str], bytes | None], Awaitable[Result | None]]


class Fallback(Exception):
    """Not for the fast path: FastAPI answers it."""


def _rank(text: str) -> int:
    # ASCII digits only: str.isdigit() also takes superscripts and other scripts' digits,
    # which FastAPI refuses (422).
    if not (text.isascii() and text.isdigit()) or len(text) > 6 or int(text) >= MAX_TP_SIZE:
        raise Fallback
    return int(text)


def _group(text: str) -> str:
    if _GROUP.fullmatch(text) is None:  # match() would let a final "\n" through "$"
        raise Fallback
    return text


# Where a body's ``Any`` values are: a registration's are kv's extra keys (kv sits at nesting
# 1 of a rank's body, 3 of a batch's: body -> agents -> [i] -> kv).
FreeParts = tuple[Callable[[Any], list[dict[str, Any]]], int]
_ONE_KV: FreeParts = (lambda body: [body.kv.__pydantic_extra__ or {}], 1)
_BATCH_KV: FreeParts = (lambda body: [a.kv.__pydantic_extra__ or {} for a in body.agents], 3)
_NONE: FreeParts = (lambda body: [], 0)  # a heartbeat's body: typed throughout


def _body(model: type[M], raw: bytes | None, free: FreeParts | None = None) -> M:
    """The body as ``model``, else ``Fallback``. With ``free`` (where the model's ``Any``
    values are), a body is first tried in one pass of pydantic's parser (``validate_json``)."""
    if not raw:
        raise Fallback
    if free is not None and (quick := validate_json(model, raw, *free)) is not None:
        return quick
    try:
        return model.model_validate(parse(raw))
    except (ValueError, ValidationError, RecursionError):
        raise Fallback from None


class FastPath:
    def __init__(self, app: ASGIApp, routes: list[BaseRoute], limit: int) -> None:
        self.app = app
        self.limit = limit
        by_path = {getattr(r, "path", ""): r for r in routes}
        self.get_engine = (self._get_engine, by_path["/tp-groups/{group_id}/engine"])
        self.open_engine = (self._open_engine, by_path["/tp-groups/{group_id}/engine"])
        self.register = (self._register, by_path["/tp-groups/{group_id}/engine/agents/{rank}"])
        self.heartbeat = (
            self._heartbeat,
            by_path["/tp-groups/{group_id}/engine/agents/{rank}/heartbeat"],
        )
        self.handshake = (self._handshake, by_path["/engines/{engine_id}/handshake"])
        self.register_batch = (self._register_batch, by_path["/tp-groups/{group_id}/engine/agents"])
        self.heartbeat_batch = (
            self._heartbeat_batch,
            by_path["/tp-groups/{group_id}/engine/agents/heartbeat"],
        )
        self._reg: Registry | None = None  # the app's, set by its lifespan before any request

    def match(self, method: str, parts: list[str]) -> tuple[Handler, BaseRoute] | None:
        n = len(parts)
        if n >= 3 and parts[0] == "tp-groups" and parts[2] == "engine":
            if n == 3:
                if method == "GET":
                    return self.get_engine
                return self.open_engine if method == "PUT" else None
            if parts[3] != "agents":
                return None
            if n == 4:
                return self.register_batch if method == "PUT" else None
            if n == 5:
                if parts[4] == "heartbeat":
                    return self.heartbeat_batch if method == "POST" else None
                return self.register if method == "PUT" else None
            if n == 6 and parts[5] == "heartbeat":
                return self.heartbeat if method == "POST" else None
        elif n == 3 and parts[0] == "engines" and parts[2] == "handshake" and method == "POST":
            return self.handshake
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["query_string"]:
            await self.app(scope, receive, send)
            return
        parts = path_parts(scope["path"])
        entry = None if parts is None else self.match(scope["method"], parts)
        if entry is None or over_limit(scope, self.limit):
            await self.app(scope, receive, send)
            return
        assert parts is not None
        handler, route = entry
        raw: bytes | None = None
        if scope["method"] != "GET":
            raw = await read_body(receive, self.limit)
            if raw is None or len(raw) > self.limit:  # disconnected, or for the body limit
                await self.app(scope, replayed(raw, receive), send)
                return
        try:
            answer = await handler(scope, parts, raw)
        except Fallback:
            answer = None
        except (RegistryError, Unavailable) as exc:
            scope["route"] = route
            await send_problem(send, at_edge(exc), scope)
            return
        if answer is None:
            await self.app(scope, replayed(raw, receive), send)
            return
        scope["route"] = route
        await send_json(send, *encoded(answer))

    def _registry(self, scope: Scope) -> Registry:
        if self._reg is None:
            self._reg = scope["app"].state.registry
        return self._reg

    async def _get_engine(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        return 200, await self._registry(scope).get_engine(_group(parts[1]))

    async def _open_engine(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        gid = _group(parts[1])
        engine, created = await self._registry(scope).open_engine(
            gid, _body(OpenEngineRequest, raw)
        )
        return (201 if created else 200), engine

    async def _register(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        gid, rank = _group(parts[1]), _rank(parts[4])
        body = _body(RegisterAgentRequest, raw, _ONE_KV)
        client = scope.get("client")
        agent, created = await self._registry(scope).register_agent(
            gid, rank, body, client[0] if client else None
        )
        return (201 if created else 200), agent

    async def _heartbeat(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        gid, rank = _group(parts[1]), _rank(parts[4])
        body = _body(EngineIdBody, raw, _NONE)
        return 200, await self._registry(scope).heartbeat(gid, rank, body.engine_id)

    async def _register_batch(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        gid = _group(parts[1])
        body = _body(RegisterAgentsRequest, raw, _BATCH_KV)
        client = scope.get("client")
        return 200, await self._registry(scope).register_agents(
            gid, body, client[0] if client else None
        )

    async def _heartbeat_batch(self, scope: Scope, parts: list[str], raw: bytes | None) -> Result:
        gid = _group(parts[1])
        body = _body(HeartbeatsRequest, raw, _NONE)
        renewed = await self._registry(scope).renew_agents(gid, body.engine_id, body.ranks)
        return 200, heartbeats_json(renewed)

    async def _handshake(
        self, scope: Scope, parts: list[str], raw: bytes | None
    ) -> tuple[int, BaseModel]:
        engine_id = parts[1]
        if not 1 <= len(engine_id) <= 128:
            raise Fallback
        body = _body(HandshakeRequest, raw)
        if body.decode is not None:
            check_scope(scope, body.decode.group_id, "the decode group")
        return 200, await self._registry(scope).handshake(engine_id, body)


def path_parts(path: str) -> list[str] | None:
    """The segments of a path as the routes spell it (``/tp-groups/g1/engine``), else None.

    The one path rule of the hot path and the fast path: a path with a trailing slash, an
    empty segment (``//``) or no leading slash is never theirs, so it goes on to the full
    stack, which answers it as docs/api.md says (307 to the path without the slash, or 404)
    whether the fast path is on or off."""
    parts = path.split("/")
    if len(parts) < 2 or parts[0] or not all(parts[1:]):
        return None
    return parts[1:]


def over_limit(scope: Scope, limit: int) -> bool:
    """The request declares a body over ``limit``: the full stack's body limit answers 413
    before anything is read (so an ``Expect: 100-continue`` client gets no ``100 Continue``)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) > limit
    return False


def encoded(answer: Result) -> tuple[int, bytes]:
    """A handler's answer as status and JSON body, serialized once by its model."""
    status, model = answer
    if isinstance(model, bytes):
        return status, model
    return status, model.__pydantic_serializer__.to_json(model)


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode()), *_JSON]  # JSONResponse's order
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The body, or as much of it as passes ``limit`` (the caller hands that on); None when the
    client went away."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit or not message.get("more_body", False):
            return b"".join(chunks)


def replayed(raw: bytes | None, receive: Receive) -> Receive:
    return receive if raw is None else replay(raw, receive)


def heartbeats_json(renewed: list[tuple[int, str]]) -> bytes:
    """``Heartbeats`` as its model serializes it (the expiries are ASCII: nothing to escape)."""
    return b'{"agents":[%s]}' % b",".join(
        b'{"rank":%d,"expires_at":"%s"}' % (r, at.encode()) for r, at in renewed
    )
