"""/tp-groups: engines per launch, and each rank's agent registration."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status

from app.api.deps import GroupIdPath, RankPath, RegistryDep, answer, refuse_oversized_body
from app.core.schemas import (
    Agent,
    Agents,
    Engine,
    EngineIdBody,
    Groups,
    Heartbeat,
    Heartbeats,
    HeartbeatsRequest,
    OpenEngineRequest,
    RegisterAgentRequest,
    RegisterAgentsRequest,
    Role,
    ServingRequest,
)
from app.server.jsonbody import LimitedJsonRoute
from app.watch.history import Selector
from app.watch.pages import read_page
from app.watch.stream import Watchers

router = APIRouter(prefix="/tp-groups", tags=["tp-groups"], route_class=LimitedJsonRoute)


@router.get(
    "",
    response_model=Groups,
    summary="Current engine of every group, in pages; or, with watch=true, a stream of changes",
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def list_groups(
    registry: RegistryDep,
    request: Request,
    watch: Annotated[
        bool, Query(description="Stream every change after `revision`, one JSON per line.")
    ] = False,
    revision: Annotated[
        int | None,
        Query(ge=0, description="watch: the changes after this revision (default: from now)."),
    ] = None,
    limit: Annotated[
        int | None, Query(ge=1, le=10_000, description="At most this many groups a page.")
    ] = None,
    continue_: Annotated[
        str | None,
        Query(alias="continue", max_length=512, description="The previous page's `continue`."),
    ] = None,
    role: Annotated[Role | None, Query(description="Only groups of this role.")] = None,
    model: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=512,
            description='Only groups whose `compat["model"]` is this (exactly).',
        ),
    ] = None,
) -> Response:
    watchers: Watchers = request.app.state.watchers
    selector = Selector(role, model)
    if watch:
        stream = await watchers.watch(revision, selector, request.app.state.store_timeout_s)
        request.app.state.tokens.hold(stream, request.scope)
        return stream
    body = await read_page(
        watchers.feed,
        registry.store,
        registry.decoded,
        limit=limit,
        token=continue_,
        selector=selector,
        timeout_s=request.app.state.store_timeout_s,
    )
    return Response(body, media_type="application/json")


@router.put(
    "/{group_id}/engine",
    response_model=Engine,
    status_code=status.HTTP_201_CREATED,
    summary="TP rank 0 opens the engine of its launch",
    responses={200: {"model": Engine, "description": "This launch's engine, opened before"}},
)
async def open_engine(
    group_id: GroupIdPath, body: OpenEngineRequest, registry: RegistryDep
) -> Response:
    engine, created = await registry.open_engine(group_id, body)
    return answer(engine, status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@router.get("/{group_id}/engine", response_model=Engine, summary="The group's current engine")
async def get_engine(
    group_id: GroupIdPath,
    registry: RegistryDep,
    wait_ready: Annotated[
        float | None,
        Query(ge=0, le=60, description="Hold the answer until ready or this many seconds pass."),
    ] = None,
) -> Response:
    return answer(await registry.get_engine(group_id, wait_ready))


@router.delete(
    "/{group_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Forget a group entirely"
)
async def delete_group(group_id: GroupIdPath, registry: RegistryDep, request: Request) -> Response:
    refuse_oversized_body(request)
    await registry.delete_group(group_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put(
    "/{group_id}/engine/agents/{rank}",
    response_model=Agent,
    status_code=status.HTTP_201_CREATED,
    summary="Register (or replace) a rank's NIXL agent",
    responses={200: {"model": Agent, "description": "Replaced the rank's live agent"}},
)
async def register_agent(
    group_id: GroupIdPath,
    rank: RankPath,
    body: RegisterAgentRequest,
    registry: RegistryDep,
    request: Request,
) -> Response:
    client = request.client.host if request.client else None
    agent, created = await registry.register_agent(group_id, rank, body, client)
    return answer(agent, status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@router.put(
    "/{group_id}/engine/agents",
    response_model=Agents,
    summary="Register several ranks' agents at once (one transaction, one shared lease)",
)
async def register_agents(
    group_id: GroupIdPath, body: RegisterAgentsRequest, registry: RegistryDep, request: Request
) -> Response:
    client = request.client.host if request.client else None
    return answer(await registry.register_agents(group_id, body, client))


@router.post(
    "/{group_id}/engine/agents/heartbeat",
    response_model=Heartbeats,
    summary="Renew the leases of several ranks at once",
)
async def heartbeat_agents(
    group_id: GroupIdPath, body: HeartbeatsRequest, registry: RegistryDep
) -> Response:
    return answer(await registry.heartbeat_agents(group_id, body.engine_id, body.ranks))


@router.post(
    "/{group_id}/engine/agents/{rank}/heartbeat",
    response_model=Heartbeat,
    summary="Renew a rank's lease",
)
async def heartbeat(
    group_id: GroupIdPath, rank: RankPath, body: EngineIdBody, registry: RegistryDep
) -> Response:
    return answer(await registry.heartbeat(group_id, rank, body.engine_id))


@router.delete(
    "/{group_id}/engine/agents/{rank}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Deregister a rank's agent",
)
async def deregister_agent(
    group_id: GroupIdPath,
    rank: RankPath,
    registry: RegistryDep,
    engine_id: Annotated[str, Query(min_length=1, max_length=128)],
    request: Request,
) -> Response:
    refuse_oversized_body(request)
    await registry.deregister(group_id, rank, engine_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put(
    "/{group_id}/engine/serving",
    response_model=Engine,
    summary="Publish where the current engine's instance serves (its API URL), for routers",
)
async def publish_serving(
    group_id: GroupIdPath, body: ServingRequest, registry: RegistryDep
) -> Response:
    return answer(await registry.publish_serving(group_id, body))


@router.delete(
    "/{group_id}/engine/serving",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Withdraw where the instance serves (it stops serving)",
)
async def withdraw_serving(
    group_id: GroupIdPath,
    registry: RegistryDep,
    engine_id: Annotated[str, Query(min_length=1, max_length=128)],
    request: Request,
) -> Response:
    refuse_oversized_body(request)
    await registry.withdraw_serving(group_id, engine_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
