"""Liveness, readiness and metrics: no token needed."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import RegistryDep
from app.core.metrics import CONTENT_TYPE
from app.store import Unavailable

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="200 while the process serves")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="200 when the store answers, else 503 store_unavailable")
async def readyz(registry: RegistryDep) -> dict[str, str]:
    try:
        await registry.store.ping()
    except Unavailable:
        registry.metrics.store_up.set(0)
        raise
    registry.metrics.store_up.set(1)
    return {"status": "ready", "store": registry.store.description}


@router.get("/metrics", summary="Prometheus text format")
async def metrics(registry: RegistryDep) -> Response:
    try:
        await registry.refresh_gauges()
        registry.metrics.store_up.set(1)
    except Unavailable:
        registry.metrics.store_up.set(0)
    return Response(registry.metrics.render(), media_type=CONTENT_TYPE)
