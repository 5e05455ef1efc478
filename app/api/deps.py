"""Typed dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from app.registry import Registry
from app.schemas import GROUP_ID_PATTERN, MAX_TP_SIZE


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
