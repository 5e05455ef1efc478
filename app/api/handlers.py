"""FastAPI's exception handlers: every error the routes, FastAPI or Starlette raise is
answered as problem+json (``app.core.problems``) with a stable ``code``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.core.errors import (
    HttpProblem,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RegistryError,
    at_edge,
)
from app.core.problems import field_errors, problem_response
from app.server.jsonbody import JsonLimitError
from app.server.middleware import TOO_LARGE
from app.store import Unavailable

log = logging.getLogger("app")

Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]


def exception_handlers(max_body_bytes: int) -> dict[int | type[Exception], Handler]:
    """The handlers for ``FastAPI(exception_handlers=...)``; ``max_body_bytes`` is named in
    the 413 a body cut at the limit turns into."""

    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = field_errors(list(exc.errors()))
        if request.scope.get("state", {}).get(TOO_LARGE):
            outside_body = [e for e in errors if not e["loc"] or e["loc"][0] != "body"]
            if not outside_body:
                return problem_response(
                    PayloadTooLarge(
                        f"The request body is larger than {max_body_bytes} bytes "
                        "(REGISTRY_MAX_BODY_BYTES). Agent metadata blobs must fit in it."
                    ),
                    request.scope,
                )
            errors = outside_body
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:5])
        return problem_response(
            InvalidRequest(f"The request is invalid: {where}", errors=errors), request.scope
        )

    return {
        RegistryError: on_registry_error,
        Unavailable: on_store_unavailable,
        RequestValidationError: on_invalid,
        StarletteHTTPException: on_http,
        Exception: on_unexpected,
    }


async def on_registry_error(request: Request, exc: RegistryError) -> Response:
    return problem_response(exc, request.scope)


async def on_store_unavailable(request: Request, exc: Unavailable) -> Response:
    return problem_response(at_edge(exc), request.scope)


async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        error: RegistryError = NotFound(f"No such path: {request.url.path}")
    elif exc.status_code == 400:
        # FastAPI answers 400 when parsing the body fails with anything but a
        # JSONDecodeError (an integer of more than 4300 digits, say); the contract: 422.
        cause = exc.__cause__
        why = str(cause or exc.detail)
        if isinstance(cause, JsonLimitError):
            where = ".".join(map(str, cause.loc))
            error = InvalidRequest(
                f"The request body breaks a JSON limit at {where}: {why}",
                errors=[{"loc": cause.loc, "msg": why, "type": "json_limit"}],
            )
        else:
            error = InvalidRequest(
                f"The request body cannot be parsed as JSON: {why}",
                errors=[{"loc": ["body"], "msg": why, "type": "json_invalid"}],
            )
    else:
        code = {405: "method_not_allowed"}.get(exc.status_code, "http_error")
        error = HttpProblem(exc.status_code, code, str(exc.detail))
    return problem_response(error, request.scope, headers=getattr(exc, "headers", None))


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", extra={"path": request.url.path})
    return problem_response(
        HttpProblem(500, "internal", "The registry failed unexpectedly; see its log."),
        request.scope,
    )
