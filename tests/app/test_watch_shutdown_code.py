"""A watch asked of a replica that is shutting down is refused ``503 shutting_down`` (the code
its open streams end with), not ``too_many_watchers``, which docs/api.md gives only for the
limit and router-sync logged as the cause. The real app and its lifespan on a real SQLite
file, in process (no socket: the refusal is the app's)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from app.server.settings import Settings

pytestmark = pytest.mark.unit


async def _watch_while_draining(db: Path) -> httpx.Response:
    app = create_app(Settings(store=f"sqlite:///{db}"))
    async with app.router.lifespan_context(app):
        app.state.watchers.drain()  # what the shutdown does (app/server/shutdown.py)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://registry") as c:
            return await c.get("/tp-groups", params={"watch": "true"}, timeout=10)


def test_a_watch_opened_during_shutdown_is_refused_shutting_down(tmp_path: Path) -> None:
    answer = asyncio.run(_watch_while_draining(tmp_path / "r.db"))
    assert answer.status_code == 503, answer.text
    problem = answer.json()
    assert problem["code"] == "shutting_down", problem
    assert "shutting down" in problem["detail"]
