"""Request bodies are parsed here, with limits on what free-form JSON may hold.

Every JSON body of the API (and the free-form parts of it: ``kv`` extras, ``compat``) is
refused with 422 when it holds:

- nesting deeper than :data:`MAX_DEPTH` levels (a 200-deep value once parsed fine on the way
  in and failed every later read of the group: one request poisoned the registry);
- more than :data:`MAX_NODES` values in all;
- ``NaN``, ``Infinity``, ``-Infinity`` or a number too large for a double (``1e309``): not
  JSON numbers in RFC 8259, and stored as ``null`` by most encoders;
- a lone UTF-16 surrogate escape (``"\\ud800"``): no UTF-8 string can carry it, so it could
  be neither stored nor answered.

Duplicate keys in one object are allowed and the last one wins (what most JSON parsers do).

The checks cost almost nothing on the usual bodies: a body whose count of ``[``/``{`` and
``,`` is under the limits, and that has no ``\\uD8`` to ``\\uDF`` escape, is not walked at all
(a base64 metadata blob contains none of those characters).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

MAX_DEPTH = 32
MAX_NODES = 200_000

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
M = TypeVar("M", bound=BaseModel)


class JsonLimitError(ValueError):
    """A body that parses as JSON but breaks a limit; ``loc`` says where."""

    def __init__(self, msg: str, loc: list[str | int]) -> None:
        super().__init__(msg)
        self.msg = msg
        self.loc = loc


def _constant(name: str) -> Any:
    raise JsonLimitError(f"{name} is not a JSON number", ["body"])


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonLimitError(f"number {text[:40]} does not fit a double", ["body"])
    return value


def _walk(value: Any, surrogates: bool) -> None:
    """Depth, size and (when the raw body had such escapes) lone surrogates."""
    nodes = 0
    stack: list[tuple[Any, list[str | int]]] = [(value, ["body"])]
    while stack:
        item, loc = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise JsonLimitError(f"more than {MAX_NODES} JSON values", ["body"])
        if len(loc) - 1 > MAX_DEPTH:
            raise JsonLimitError(f"nested deeper than {MAX_DEPTH} levels", loc[: MAX_DEPTH + 2])
        if isinstance(item, dict):
            for key, child in item.items():
                if surrogates:
                    _check_text(key, loc)
                stack.append((child, [*loc, key]))
        elif isinstance(item, list):
            stack.extend((child, [*loc, i]) for i, child in enumerate(item))
        elif surrogates and isinstance(item, str):
            _check_text(item, loc)


def _check_text(text: str, loc: list[str | int]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonLimitError(
            "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
            loc[: MAX_DEPTH + 2],
        ) from None


# One decoder for every body (json.loads with hooks builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float)


def _surrogates(body: bytes) -> bool:
    # A one-byte search first: memchr, where the two-byte pattern cost 50 µs in 55 KB.
    return b"\\" in body and _SURROGATE_ESCAPE.search(body) is not None


def parse(body: bytes) -> Any:
    """``json.loads`` with this module's limits (see the module doc). Bodies are UTF-8
    (RFC 8259); anything else is refused as not JSON."""
    value = _DECODER.decode(body.decode("utf-8"))
    surrogates = _surrogates(body)
    nested = body.count(b"[") + body.count(b"{")
    # n values take at least 2n - 1 bytes ("0,0,…"): a shorter body cannot hold too many.
    many = len(body) >= 2 * MAX_NODES - 1 and body.count(b",") + nested >= MAX_NODES
    if surrogates or nested > MAX_DEPTH or many:
        _walk(value, surrogates)
    return value


def _plain(value: Any, depth: int) -> bool:
    """No ``NaN`` or infinity in ``value`` (parsed JSON at nesting ``depth``), and nothing in
    it nested deeper than :data:`MAX_DEPTH`."""
    stack = [(value, depth)]
    while stack:
        item, at = stack.pop()
        if at > MAX_DEPTH:
            return False
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend((child, at + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, at + 1) for child in item)
    return True


def validate_json(
    model: type[M], body: bytes, free: Callable[[M], list[dict[str, Any]]], depth: int
) -> M | None:
    """``model.model_validate(parse(body))`` in one pass of pydantic's own JSON parser, where
    that is sure to give the same model; None where it cannot tell, and the caller takes
    the long way, which answers (a 422 included) as before.

    Two passes cost twice: a node's batch registration (8 ranks, 55 KB of JSON) took 170 µs
    to parse and 230 more to validate, against about 110 for both at once
    (``docs/benchmarks.md``). pydantic's parser differs from :func:`parse` only where this
    module's limits apply: it takes ``NaN``, ``Infinity`` and numbers past a double (as
    infinities), lone surrogate escapes and any nesting. The model's typed parts refuse
    all of these themselves (strict types; floats without infinities; a fixed depth under
    :data:`MAX_DEPTH`), so what is checked is the rest: a body with a surrogate escape, or
    long enough to hold more than :data:`MAX_NODES` values, is not taken; and ``free(model)``,
    the objects that hold the model's ``Any`` values (kv's extra keys), each standing at
    nesting ``depth`` in the body, must hold no infinity or ``NaN`` and nest within the limit.
    """
    if len(body) >= 2 * MAX_NODES - 1 or _surrogates(body):
        return None
    try:
        value = model.model_validate_json(body)
    except ValidationError:
        return None
    return value if all(_plain(part, depth) for part in free(value)) else None


class LimitedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse(await self.body())
        return self._json


class LimitedJsonRoute(APIRoute):
    """Routes whose JSON bodies go through :func:`parse`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            return await handler(LimitedJsonRequest(request.scope, request.receive))

        return limited
