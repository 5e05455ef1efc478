"""Domain errors name the field as the domain knows it; the HTTP edge says where it came from
(the matched route's path parameters, else the body) when it answers."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from app.core.errors import FieldProblem, InvalidRequest
from app.core.problems import problem_response
from app.registry.base import outside_group

pytestmark = pytest.mark.unit


def answer(error: InvalidRequest, template: str) -> list[dict[str, Any]]:
    scope = {"path": "/x", "route": SimpleNamespace(path=template)}
    body = json.loads(bytes(problem_response(error, scope).body))
    assert body["status"] == 422
    errors: list[dict[str, Any]] = body["errors"]
    return errors


def test_a_field_of_the_routes_path_is_located_in_the_path() -> None:
    error = outside_group("g", 5, 2, ("rank",))
    errors = answer(error, "/tp-groups/{group_id}/engine/agents/{rank}")
    assert errors == [
        {"loc": ["path", "rank"], "msg": "must be below tp_size 2", "type": "less_than"}
    ]


def test_a_field_the_path_does_not_take_is_located_in_the_body() -> None:
    error = outside_group("g", 5, 2, ("agents", 1, "rank"), where=" (agents[1])")
    errors = answer(error, "/tp-groups/{group_id}/engine/agents")
    assert errors[0]["loc"] == ["body", "agents", 1, "rank"]
    ranks = answer(outside_group("g", 5, 2, ("ranks",)), "/tp-groups/{group_id}/engine/agents")
    assert ranks[0]["loc"] == ["body", "ranks"]


def test_errors_the_http_layer_gave_stay_as_given() -> None:
    given = [{"loc": ["query", "since"], "msg": "bad", "type": "since"}]
    error = InvalidRequest("bad", errors=given, fields=[FieldProblem(("rank",), "x", "y")])
    assert answer(error, "/events") == given
