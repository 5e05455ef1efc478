"""Typed dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request, Response
from pydantic import BaseModel

from app.core.errors import PayloadTooLarge
from app.core.schemas import GROUP_ID_PATTERN, MAX_TP_SIZE
from app.registry import Registry
from app.server.middleware import TOO_LARGE


async def get_registry(request: Request) -> Registry:
    # async on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, one
    # thread hop per request for a dictionary lookup.
    registry: Registry = request.app.state.registry
    return registry


RegistryDep = Annotated[Registry, Depends(get_registry)]
GroupIdPath = Annotated[
    str, Path(pattern=GROUP_ID_PATTERN, description="TP group id", examples=["prefill-0"])
]
RankPath = Annotated[int, Path(ge=0, lt=MAX_TP_SIZE, description="TP rank")]
EngineIdPath = Annotated[str, Path(min_length=1, max_length=128)]


def refuse_oversized_body(request: Request) -> None:
    """For routes without a body: past the size limit is 413 before any state is read (the
    contract's order: shape, size, existence, state), not silently ignored."""
    if request.scope.get("state", {}).get(TOO_LARGE):
        raise PayloadTooLarge(
            "The request body is larger than the registry's limit (REGISTRY_MAX_BODY_BYTES); "
            "this route takes no body: send none."
        )


def answer(model: BaseModel, status_code: int = 200) -> Response:
    """The model as JSON, serialized once (by pydantic-core) and passed through as is:
    FastAPI would validate a returned model against ``response_model`` again first. The
    decorators still name ``response_model``, so ``/openapi.json`` stays complete."""
    return Response(
        model.__pydantic_serializer__.to_json(model),
        status_code=status_code,
        media_type="application/json",
    )
