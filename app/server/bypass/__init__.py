"""The request bypass: the hot routes answered without FastAPI's (or uvicorn's) per-request
machinery, same contract (`fastpath`: an ASGI middleware; `hot` and `wire`: in front of every
ASGI layer and in the connection's protocol; `keepalive_wire`: keep-alive renewals read in the
WebSocket connection's protocol). ``REGISTRY_FAST_PATH=false`` switches all of it off at once.
`hot`, `wire` and `keepalive_wire` use internals of uvicorn (pyproject.toml pins the minor
release they were written and tested for); where one is missing they stay off, with one log
line, and the full stack answers (`unavailable`)."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger("app")

# What `hot` and `wire` take from uvicorn, beyond its public API: (module, attribute path).
INTERNALS = (
    ("uvicorn.protocols.http.httptools_impl", "STATUS_LINE"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol._start_asgi_task"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_headers_complete"),
    ("uvicorn._types", "ASGI3Application"),
    ("uvicorn.protocols.websockets.websockets_sansio_impl", "WebSocketsSansIOProtocol"),
    (
        "uvicorn.protocols.websockets.websockets_sansio_impl",
        "WebSocketsSansIOProtocol.data_received",
    ),
    (
        "uvicorn.protocols.websockets.websockets_sansio_impl",
        "WebSocketsSansIOProtocol.handle_connect",
    ),
    ("websockets.speedups", "apply_mask"),
)


def unavailable() -> str | None:
    """The first uvicorn internal the bypass needs and this uvicorn lacks, said with the fix;
    ``None`` when every one is there."""
    for module, path in INTERNALS:
        try:
            found: object = importlib.import_module(module)
            for part in path.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            try:
                release = version("uvicorn")
            except PackageNotFoundError:  # pragma: no cover - uvicorn runs this code
                release = "?"
            return (
                f"uvicorn {release} has no {module}.{path}: the request bypass is off and the "
                "full stack answers every request (install the uvicorn release pyproject.toml "
                "pins to have it back)"
            )
    return None


def wanted(fast_path: bool) -> bool:
    """Whether the uvicorn-level bypass (`hot`, `wire`) runs: asked (``REGISTRY_FAST_PATH``) and
    possible. Logs one line when asked but impossible."""
    if not fast_path:
        return False
    missing = unavailable()
    if missing is not None:
        log.warning(missing, extra={"bypass": "off"})
        return False
    return True
