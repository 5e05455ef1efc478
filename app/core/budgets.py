"""How many bytes a client can make the registry keep: one place for every budget.

docs/operations.md ("Budgets") states each of them and what a client gets past it.

- ``MAX_TEXT``: every free-form string a client sends that the registry keeps (a ``compat``
  value, a string or key anywhere in ``kv``'s extra members) is at most this many
  characters; past it the request answers 422 and nothing is stored. Identifiers have
  tighter rules of their own (``launch_id``, ``engine_id``, ``agent_name``: 256; ``host``:
  253; ``group_id``: 64; ``compat`` keys: 128).
- ``SHOWN_CHARS``: a client's value repeated in an answer's ``detail``, a problem member or
  an event is cut to this many characters, with a marker saying how many more there were
  (:func:`clip`). The whole value is never repeated.
- ``EVENT_BYTES``: one event, as stored, is at most this many bytes of JSON (its ``detail``
  at most ``DETAIL_CHARS`` characters; lists in its ``fields`` cut to ``LIST_ITEMS``,
  and ``fields.truncated`` says so). The log keeps ``REGISTRY_EVENTS_KEEP`` events (plus a
  tenth), so at most ``keep * 1.1 * EVENT_BYTES`` bytes per replica writing.
- The parsed-record and blob-text caches are bounded in bytes
  (``app.registry.records.RECORDS_BYTES``, ``TEXTS_BYTES``).
"""

from __future__ import annotations

import json
from typing import Any

MAX_TEXT = 1024
SHOWN_CHARS = 128
EVENT_BYTES = 4096
DETAIL_CHARS = 1024
LIST_ITEMS = 16


def clip(value: Any, limit: int = SHOWN_CHARS) -> Any:
    """A string cut to ``limit`` characters with a marker (``…[+N chars]``) when longer;
    any other value as it is."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}…[+{len(value) - limit} chars]"
    return value


def too_long(value: Any, limit: int = MAX_TEXT) -> str | None:
    """Where in ``value`` (free-form JSON) a string or key is longer than ``limit``
    characters, as a readable path, else None. Numbers are passed over without making their
    path (a rank's 80 KV base addresses took a twentieth of a fleet's registrations)."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if len(item) > limit:
                return _path(path) or "value"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if len(key) > limit:
                    where = _path(path)
                    return f"{where}.{clip(key, 32)}" if where else clip(key, 32)
                if isinstance(sub, str | dict | list):
                    stack.append(((*path, key), sub))
        elif isinstance(item, list):
            nested = ((i, sub) for i, sub in enumerate(item) if isinstance(sub, str | dict | list))
            stack.extend(((*path, i), sub) for i, sub in nested)
    return None


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def bounded_event(detail: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An event's ``detail`` and ``fields`` within ``EVENT_BYTES`` of JSON: strings cut by
    :func:`clip`, lists to ``LIST_ITEMS``, and ``fields.truncated`` set when anything was
    cut; fields that still do not fit are left out (``{"truncated": true}``)."""
    cut = False

    def shrink(value: Any, items: int) -> Any:
        nonlocal cut
        if isinstance(value, str):
            shown = clip(value, 256)
            cut = cut or shown is not value
            return shown
        if isinstance(value, list):
            cut = cut or len(value) > items
            return [shrink(v, items) for v in value[:items]]
        if isinstance(value, dict):
            return {clip(str(k), 256): shrink(v, items) for k, v in value.items()}
        return value

    short = clip(detail, DETAIL_CHARS)
    if len(short.encode()) > DETAIL_CHARS * 3 // 2:  # wide characters: fewer of them
        short = clip(detail, DETAIL_CHARS // 4)
    for items in (LIST_ITEMS, 4):
        out = shrink(fields, items)
        if cut:
            out["truncated"] = True
        if len(json.dumps(out)) + len(short.encode()) + 512 <= EVENT_BYTES:
            return short, out
    return short, {"truncated": True}
