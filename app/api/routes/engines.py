"""/engines: resolve an engine_id, and plan a decode rank's handshake."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import EngineIdPath, RegistryDep, answer
from app.core.schemas import Engine, Handshake, HandshakeRequest
from app.security.auth import check_scope
from app.server.jsonbody import LimitedJsonRoute

router = APIRouter(prefix="/engines", tags=["engines"], route_class=LimitedJsonRoute)


@router.get("/{engine_id}", response_model=Engine, summary="Resolve an engine_id")
async def resolve(engine_id: EngineIdPath, registry: RegistryDep) -> Response:
    return answer((await registry.resolve(engine_id)).view())


@router.post(
    "/{engine_id}/handshake",
    response_model=Handshake,
    summary="What a decode rank must load from this prefill engine",
)
async def handshake(
    engine_id: EngineIdPath, body: HandshakeRequest, registry: RegistryDep, request: Request
) -> Response:
    if body.decode is not None:
        check_scope(request.scope, body.decode.group_id, "the decode group")
    return answer(await registry.handshake(engine_id, body))
