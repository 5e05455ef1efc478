"""vLLM's MooncakeConnector bootstrap protocol (docs/api.md "Mooncake bootstrap"): prefill
workers post to ``/register`` at the root, as vLLM does with ``bootstrap_server_address``
set to the registry; a decode's ``remote_bootstrap_addr`` is ``{registry}/mooncake/{engine_id}``
and vLLM reads ``{remote_bootstrap_addr}/query``."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response

from app.api.deps import EngineIdPath, RegistryDep, refuse_oversized_body
from app.core.schemas import MooncakeRegistration
from app.security.auth import check_scope
from app.server.jsonbody import LimitedJsonRoute

router = APIRouter(tags=["mooncake"], route_class=LimitedJsonRoute)

OK = b'{"status":"ok"}'  # what vLLM's own bootstrap server answers


@router.post("/register", summary="A MooncakeConnector prefill worker registers")
async def register(body: MooncakeRegistration, registry: RegistryDep, request: Request) -> Response:
    await registry.mooncake_register(body, lambda gid: check_scope(request.scope, gid, "the group"))
    return Response(OK, media_type="application/json")


@router.get(
    "/mooncake/{engine_id}/query",
    summary="One prefill engine's workers, as vLLM's bootstrap server answers",
)
async def query(engine_id: EngineIdPath, registry: RegistryDep, request: Request) -> Response:
    refuse_oversized_body(request)
    workers = await registry.mooncake_query(engine_id)
    return Response(json.dumps(workers, separators=(",", ":")), media_type="application/json")
