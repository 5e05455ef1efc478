"""/instances: the instances ready to serve, by role and model, for routers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import RegistryDep
from app.core.schemas import Role
from app.watch.instances import read_instances
from app.watch.stream import Watchers

router = APIRouter(prefix="/instances", tags=["instances"])


class Instances(BaseModel):
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    instances: list[dict[str, Any]] = Field(
        description="Ready engines that published where they serve: group_id, engine_id, "
        "generation, role, tp_size, url, model, dp_rank, bootstrap, compat, published_at."
    )
    revision: int = Field(description="The store revision read: watch /tp-groups from it.")
    continue_: str | None = Field(None, alias="continue")


@router.get(
    "",
    response_model=Instances,
    summary="Instances ready to serve (ready engines with a published URL), in pages",
)
async def list_instances(
    registry: RegistryDep,
    request: Request,
    role: Annotated[
        Role | None, Query(description="prefill or decode (an instance of role both is either)")
    ] = None,
    model: Annotated[
        str | None, Query(min_length=1, max_length=256, description="Only this served model.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many a page.")] = 500,
    continue_: Annotated[
        str | None,
        Query(alias="continue", max_length=512, description="The previous page's `continue`."),
    ] = None,
) -> Response:
    watchers: Watchers = request.app.state.watchers
    body = await read_instances(
        watchers.feed,
        registry.store,
        registry.decoded,
        role=role,
        model=model,
        limit=limit,
        token=continue_,
        timeout_s=request.app.state.store_timeout_s,
    )
    return Response(body, media_type="application/json")
