"""/status (the operator's HTML page) and /events (what happened, as JSON): role reader."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import RegistryDep, answer
from app.api.status_html import (
    AFTER_PATTERN,
    CSP,
    MAX_PAGE_GROUPS,
    PAGE_GROUPS,
    TEMPLATES,
    Filters,
    page_context,
)
from app.registry.events import Events

router = APIRouter(tags=["status"])

EVENTS_ON_PAGE = 50


@router.get(
    "/status",
    response_class=Response,
    summary="The operator's status page (HTML): groups, ranks, hosts, leases, events",
    responses={200: {"content": {"text/html": {}}}},
)
async def status_page(
    request: Request,
    registry: RegistryDep,
    role: Annotated[Literal["", "prefill", "decode", "both"], Query()] = "",
    state: Annotated[Literal["", "ready", "not_ready"], Query()] = "",
    limit: Annotated[
        int, Query(ge=1, le=MAX_PAGE_GROUPS, description="Groups on a page, at most.")
    ] = PAGE_GROUPS,
    after: Annotated[
        str,
        Query(
            pattern=AFTER_PATTERN,
            description="The previous page's last row (its 'Next page' link gives it).",
        ),
    ] = "",
) -> Response:
    states = await registry.refresh_gauges()
    events = await registry.events.read(limit=EVENTS_ON_PAGE)
    page = page_context(
        states, events.events, registry.observer, Filters(role, state, limit, after)
    )
    return TEMPLATES.TemplateResponse(
        request,
        "status.html",
        page,
        headers={
            "content-security-policy": CSP,
            "cache-control": "no-store",
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        },
    )


@router.get("/events", response_model=Events, summary="Refusals, handshakes and lease expiries")
async def events(
    registry: RegistryDep,
    since: Annotated[
        str | None,
        Query(
            max_length=64,
            description="An event id (the last_id of a previous answer; exclusive) or an "
            "RFC 3339 time (inclusive).",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, newest.")] = 100,
) -> Response:
    return answer(await registry.events.read(since, limit))
