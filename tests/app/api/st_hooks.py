"""Schemathesis hooks for the fuzz test (loaded through ``SCHEMATHESIS_HOOKS``)."""

from __future__ import annotations

from typing import Any

import schemathesis
from pydantic import TypeAdapter, ValidationError

# wait_ready holds an answer up to 60 s; the fuzz run caps valid values so that it stays
# short (its bound is tested elsewhere). Invalid values pass through unchanged.
WAIT_CAP_S = 1.0


@schemathesis.hook
def before_call(ctx: schemathesis.HookContext, case: Any, kwargs: Any) -> None:
    query = case.query
    if isinstance(query, dict) and "watch" in query:
        # GET /tp-groups?watch=true streams until the client leaves (its own tests bound
        # it): the fuzz run lists instead. Values that are not booleans pass (422).
        try:
            watching = TypeAdapter(bool).validate_python(query["watch"])
        except ValidationError:
            watching = False
        if watching:
            query["watch"] = "false"
    if not isinstance(query, dict) or "wait_ready" not in query:
        return
    try:
        value = float(query["wait_ready"])
    except (TypeError, ValueError):
        return
    if WAIT_CAP_S < value <= 60:
        query["wait_ready"] = WAIT_CAP_S


@schemathesis.check
def errors_are_problem_json(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: Any
) -> bool | None:
    if response.status_code < 400:
        return None
    ctype = (response.headers.get("content-type") or [""])[0]
    assert ctype.startswith("application/problem+json"), (
        f"{response.status_code} answered as {ctype!r}, not application/problem+json"
    )
    body = response.json()
    missing = [k for k in ("type", "title", "status", "detail", "code") if k not in body]
    assert not missing, f"problem body lacks {missing}: {body}"
    assert body["status"] == response.status_code, f"status {body['status']} in the body"
    return True
