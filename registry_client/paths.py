"""The registry's URL paths, built from ids that are checked and escaped.

An engine id reaches the decode side from a request's ``kv_transfer_params``, that is from a
router or a client: ``../admin/tokens``, ``x?y`` or ``x#y`` put in a path unescaped would send
the request to another route. So every id is checked against the registry's own grammar
(``app/core/schemas.py``: ``GROUP_ID_PATTERN``, ``ENGINE_ID_PATTERN``; a unit test keeps these
copies equal) before any request, with an `InvalidId` naming the value (quoted) and the
grammar, and every segment is escaped besides (``quote(..., safe="")``). `check_path` refuses
any path that would leave its route (a dot segment, ``?``, ``#``, ``%``, any character outside
the URL's unreserved set), whoever built it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import quote

from registry_client.errors import WorkersError

GROUP_ID_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$"
ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._~-]{0,127}$"
_GROUP = re.compile(GROUP_ID_PATTERN.rstrip("$"))
_ENGINE = re.compile(ENGINE_ID_PATTERN.rstrip("$"))
_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)+")


class InvalidId(WorkersError, ValueError):
    """An id outside the registry's grammar: refused before any request is sent."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def group_segment(group_id: str) -> str:
    """``group_id`` as a path segment; `InvalidId` outside ``GROUP_ID_PATTERN``."""
    if not isinstance(group_id, str) or _GROUP.fullmatch(group_id) is None:
        raise InvalidId(
            f"group id {_shown(group_id)} is not a group id of the registry (1-64 of a-z, "
            "0-9, '.', '_', '-', starting and ending with a letter or digit): no request sent"
        )
    return quote(group_id, safe="")


def engine_segment(engine_id: str) -> str:
    """``engine_id`` as a path segment; `InvalidId` outside ``ENGINE_ID_PATTERN``."""
    if not isinstance(engine_id, str) or _ENGINE.fullmatch(engine_id) is None:
        raise InvalidId(
            f"engine id {_shown(engine_id)} is not an engine id of the registry (1-128 of "
            "A-Z, a-z, 0-9, '.', '_', '~', '-', starting with a letter or digit; the "
            "registry issues UUIDs): no request sent. It came from whoever named it (a "
            "request's kv_transfer_params): check the router or client that sent it"
        )
    return quote(engine_id, safe="")


def rank_segment(rank: int) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidId(f"rank {_shown(rank)} is not a non-negative integer: no request sent")
    return str(rank)


def check_path(path: str) -> str:
    """``path`` when it stays on its route: absolute, segments of unreserved characters
    (no escapes: checked ids need none), no dot segment, no query or fragment."""
    segments = path.split("/")[1:]
    if _PATH.fullmatch(path) is None or any(s in (".", "..") for s in segments):
        raise InvalidId(
            f"path {_shown(path)} would leave its route (dot segment, '?', '#' or a "
            "character to escape): build it from checked ids (registry_client.paths): no request "
            "sent"
        )
    return path


def normalize_urls(urls: str | Sequence[str]) -> list[str]:
    """The registry's replica URLs: a string may list several, comma-separated."""
    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        for part in item.split(","):
            part = part.strip().rstrip("/")
            if part:
                out.append(part)
    if not out:
        raise ValueError("at least one registry URL is needed")
    return out


def group_path(group_id: str) -> str:
    """``/tp-groups/{group_id}``, the id checked and escaped."""
    return "/tp-groups/" + group_segment(group_id)


def engine_path(engine_id: str) -> str:
    """``/engines/{engine_id}``, the id checked and escaped."""
    return "/engines/" + engine_segment(engine_id)
