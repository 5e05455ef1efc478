"""The request bypass (app/server/bypass) uses internals of uvicorn: where one is missing it
stays off, with one log line naming it and the fix, and the full stack answers every route.
Here a real registry process runs on a uvicorn whose ``uvicorn._types.ASGI3Application`` was
removed (a ``sitecustomize`` on ``PYTHONPATH``, after uvicorn's own modules took it): without
the switch the registry failed to start (``ImportError`` from app/server/bypass/wire.py)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from app.server import bypass
from app.server.bypass.fastpath import FastPath
from app.server.serve import uvicorn_options
from app.server.settings import Settings
from harness.server import RegistryProcess
from tests.app.api.conftest import agent_body

pytestmark = pytest.mark.api

# uvicorn's modules that take the name at import, imported before it goes (those installed).
REMOVE_ONE = """
import importlib
for name in ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl",
             "uvicorn.protocols.websockets.websockets_impl",
             "uvicorn.protocols.websockets.wsproto_impl",
             "uvicorn.middleware.message_logger", "uvicorn.middleware.proxy_headers"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
import uvicorn._types
del uvicorn._types.ASGI3Application
"""
MISSING = "uvicorn._types.ASGI3Application"


def test_a_missing_uvicorn_internal_turns_the_bypass_off_and_the_full_stack_answers(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REMOVE_ONE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "registry.log"
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with (
        RegistryProcess(url, log_path=log, env={"PYTHONPATH": path}) as proc,
        httpx.Client(base_url=proc.url, timeout=10) as c,
    ):
        body = {"launch_id": "l-1", "tp_size": 1, "role": "prefill"}
        opened = c.put("/tp-groups/g/engine", json=body)
        assert opened.status_code == 201, opened.text
        eid = opened.json()["engine_id"]
        registered = c.put("/tp-groups/g/engine/agents/0", json=agent_body(eid, 0))
        assert registered.status_code == 201, registered.text
        beat = c.post("/tp-groups/g/engine/agents/heartbeat", json={"engine_id": eid, "ranks": [0]})
        assert beat.status_code == 200, beat.text
        assert c.get("/tp-groups/g/engine").json()["ready"] is True
    said = [line for line in log.read_text().splitlines() if "request bypass is off" in line]
    assert len(said) == 1, said
    assert MISSING in said[0]
    assert "pyproject.toml" in said[0]


def test_without_the_internal_no_part_of_the_bypass_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert bypass.unavailable() is None  # this uvicorn has every internal
    with_it = uvicorn_options(Settings())["http"]
    assert "WireProtocol" in [k.__name__ for k in with_it.__mro__]
    assert any(m.cls is FastPath for m in create_app(Settings()).user_middleware)

    missing = ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol._not_in_this_release")
    monkeypatch.setattr(bypass, "INTERNALS", (*bypass.INTERNALS, missing))
    assert "_not_in_this_release" in (bypass.unavailable() or "")
    without = uvicorn_options(Settings())["http"]
    assert "WireProtocol" not in [k.__name__ for k in without.__mro__]
    assert not any(m.cls is FastPath for m in create_app(Settings()).user_middleware)
    # and REGISTRY_FAST_PATH=false switches all of it off at once, as before
    monkeypatch.setattr(bypass, "INTERNALS", bypass.INTERNALS[:-1])
    off = Settings(fast_path=False)
    assert "WireProtocol" not in [k.__name__ for k in uvicorn_options(off)["http"].__mro__]
    assert not any(m.cls is FastPath for m in create_app(off).user_middleware)
