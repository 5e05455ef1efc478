"""The API tier: real HTTP against a real ``python -m app serve`` on loopback.

Most modules share one server (``server``, ``api``) and keep out of each other's way by giving
every test its own group ids (``gid``); modules that need a server of their own (tokens, a
small body limit, gauges, kill -9) override ``server`` or start one with
:class:`RegistryProcess`.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.app.conftest import READER, WORKER, tokens_file

PROBLEM = "application/problem+json"
_counter = itertools.count()


@contextlib.contextmanager
def tokened_registry(workdir: Path, *more_tokens: str) -> Iterator[RegistryProcess]:
    """A registry on a SQLite file in ``workdir`` with a worker and a reader token (and
    ``more_tokens`` lines): what the router-sync tests feed their routers from."""
    tokens = tokens_file(workdir, f"worker:{WORKER}", f"reader:{READER}", *more_tokens)
    with RegistryProcess(
        f"sqlite:///{workdir / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        log_path=workdir / "registry.log",
    ) as proc:
        yield proc


def sqlite_url(directory: Path) -> str:
    return f"sqlite:///{directory / 'registry.db'}"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """One registry shared by the modules that do not override it, on a fresh SQLite file.

    Tests keep apart by their group ids; a module that needs its own server (tokens, a body
    limit, exact gauge values, kill -9) overrides this fixture.
    """
    directory = tmp_path_factory.mktemp("registry")
    with RegistryProcess(sqlite_url(directory), log_path=directory / "registry.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def api(server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        yield c


def new_gid(prefix: str = "g") -> str:
    """A group id no other test uses (valid by the contract's pattern)."""
    return f"{prefix}-{next(_counter)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gid() -> str:
    return new_gid()


def launch() -> str:
    return uuid.uuid4().hex


def blob(rank: int, engine_id: str = "") -> str:
    return base64.b64encode(f"nixl-metadata:{engine_id}:{rank}".encode()).decode()


KV = {
    "mem_type": "DRAM",
    "device_id": 0,
    "base_addrs": [140234567],
    "num_blocks": 1024,
    "block_len": 65536,
}


def agent_body(engine_id: str, rank: int, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "engine_id": engine_id,
        "agent_name": f"{engine_id}-rank{rank}",
        "agent_metadata": blob(rank, engine_id),
        "host": f"10.0.0.{10 + rank % 200}",
        "kv": KV,
        "ttl_s": 600,
    }
    body.update(overrides)
    return body


def problem(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert an RFC 9457 answer with the contract's members; return its body."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].split(";")[0] == PROBLEM, resp.headers
    body: dict[str, Any] = resp.json()
    for member in ("type", "title", "status", "detail", "code"):
        assert member in body, body
    assert body["status"] == status
    assert body["code"] == code, body
    assert isinstance(body["detail"], str)
    assert body["detail"]
    assert isinstance(body["title"], str)
    assert isinstance(body["type"], str)
    return body


def invalid(resp: httpx.Response) -> list[dict[str, Any]]:
    """Assert a 422 invalid_request with field errors; return the errors."""
    body = problem(resp, 422, "invalid_request")
    errors: list[dict[str, Any]] = body["errors"]
    assert isinstance(errors, list)
    assert errors
    return errors


class Api:
    """Small helpers over one client: open engines, register agents."""

    def __init__(self, client: httpx.Client) -> None:
        self.c = client

    def open(
        self,
        group: str,
        *,
        tp_size: int = 2,
        role: str = "prefill",
        compat: dict[str, Any] | None = None,
        launch_id: str | None = None,
        expect: int = 201,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "launch_id": launch_id or launch(),
            "tp_size": tp_size,
            "role": role,
        }
        if compat is not None:
            body["compat"] = compat
        resp = self.c.put(f"/tp-groups/{group}/engine", json=body)
        assert resp.status_code == expect, resp.text
        engine: dict[str, Any] = resp.json()
        return engine

    def register(
        self, engine: dict[str, Any], rank: int, expect: int = 201, **overrides: Any
    ) -> dict[str, Any]:
        resp = self.c.put(
            f"/tp-groups/{engine['group_id']}/engine/agents/{rank}",
            json=agent_body(engine["engine_id"], rank, **overrides),
        )
        assert resp.status_code == expect, resp.text
        agent: dict[str, Any] = resp.json()
        return agent

    def register_all(self, engine: dict[str, Any], ranks: list[int] | None = None) -> None:
        for rank in range(engine["tp_size"]) if ranks is None else ranks:
            self.register(engine, rank)

    def engine(self, group: str) -> dict[str, Any]:
        resp = self.c.get(f"/tp-groups/{group}/engine")
        assert resp.status_code == 200, resp.text
        engine: dict[str, Any] = resp.json()
        return engine


@pytest.fixture(scope="module")
def reg(api: httpx.Client) -> Api:
    return Api(api)
