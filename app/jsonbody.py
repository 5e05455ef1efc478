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
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

MAX_DEPTH = 32
MAX_NODES = 200_000

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


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


def parse(body: bytes) -> Any:
    """``json.loads`` with this module's limits (see the module doc). Bodies are UTF-8
    (RFC 8259); anything else is refused as not JSON."""
    value = _DECODER.decode(body.decode("utf-8"))
    surrogates = _SURROGATE_ESCAPE.search(body) is not None
    nested = body.count(b"[") + body.count(b"{")
    # n values take at least 2n - 1 bytes ("0,0,…"): a shorter body cannot hold too many.
    many = len(body) >= 2 * MAX_NODES - 1 and body.count(b",") + nested >= MAX_NODES
    if surrogates or nested > MAX_DEPTH or many:
        _walk(value, surrogates)
    return value


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
