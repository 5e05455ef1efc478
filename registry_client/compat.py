"""Compatibility of two ``compat`` objects: every shared key has the same JSON type and value."""

from __future__ import annotations

from typing import Any

CompatValue = str | int | float | bool


def _json_kind(value: CompatValue) -> str:
    # bool is a subclass of int in Python but its own type in JSON.
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string"


def same_value(a: CompatValue, b: CompatValue) -> bool:
    """JSON equality: ``16 == 16.0``, but ``"16" != 16`` and ``true != 1``."""
    return _json_kind(a) == _json_kind(b) and a == b


def mismatches(
    remote: dict[str, CompatValue], local: dict[str, CompatValue]
) -> list[dict[str, Any]]:
    """``[{field, remote, local}]`` for every key present in both whose values differ."""
    return [
        {"field": key, "remote": remote[key], "local": local[key]}
        for key in sorted(remote.keys() & local.keys())
        if not same_value(remote[key], local[key])
    ]


def equal(a: dict[str, CompatValue], b: dict[str, CompatValue]) -> bool:
    """Same keys, and every value the same by :func:`same_value`."""
    return a.keys() == b.keys() and not mismatches(a, b)
