"""problem+json answers (RFC 9457), for FastAPI handlers and for raw ASGI middleware."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Scope, Send

from app.core.errors import InvalidRequest, RegistryError, StoreUnavailable

PROBLEM_MEDIA_TYPE = "application/problem+json"
_PARAM = re.compile(r"{(\w+)")  # a route template's path parameters


def _instance(scope: Scope) -> str:
    return str(scope.get("path", ""))


def _count(error: RegistryError, scope: Scope) -> None:
    """registry_store_unavailable counts these 503s apart from not_ready's."""
    if isinstance(error, StoreUnavailable):
        registry = getattr(getattr(scope.get("app"), "state", None), "registry", None)
        if registry is not None:
            registry.metrics.store_unavailable.inc()


def _locate(error: RegistryError, scope: Scope) -> None:
    """Say where a domain error's fields came from: the matched route's path parameters."""
    if isinstance(error, InvalidRequest) and error.fields:
        template = str(getattr(scope.get("route"), "path", ""))
        error.locate(set(_PARAM.findall(template)))


def problem_response(
    error: RegistryError, scope: Scope, headers: dict[str, str] | None = None
) -> JSONResponse:
    _count(error, scope)
    _locate(error, scope)
    return JSONResponse(
        error.problem(_instance(scope)),
        status_code=error.status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def problem_answer(
    error: RegistryError, scope: Scope, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The problem+json answer to ``error``: status, headers (in the order sent), body."""
    _count(error, scope)
    _locate(error, scope)
    body = json.dumps(error.problem(_instance(scope)), separators=(",", ":")).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        *(extra_headers or []),
    ]
    return error.status, headers, body


async def send_problem(
    send: Send,
    error: RegistryError,
    scope: Scope,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    status, headers, body = problem_answer(error, scope, extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def field_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic's errors without the echoed input (it may be a 4 MiB blob) or raw objects."""
    cleaned = []
    for err in errors:
        item: dict[str, Any] = {
            "loc": [str(p) if not isinstance(p, int) else p for p in err.get("loc", ())],
            "msg": str(err.get("msg", "")),
            "type": str(err.get("type", "")),
        }
        cleaned.append(item)
    return cleaned


def error_line(revision: int, code: str, status: int, detail: str, **extras: Any) -> bytes:
    """A watch stream's final ``ERROR`` line: the problem, at the stream's revision."""
    title = code.replace("_", " ").capitalize()
    problem: dict[str, Any] = {"type": f"urn:engine-registry:problem:{code}", "title": title}
    problem.update(status=status, detail=detail, code=code, **extras)
    line = {"type": "ERROR", "revision": revision, "object": problem}
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"
