"""The registry's side of a graceful shutdown (SIGTERM), run before uvicorn's own
(`app.server.serve.RegistryServer.shutdown`), in an order that keeps the watch promise:

1. stop accepting connections; every held ``wait_ready`` answers now; each connection is told
   to shut down (uvicorn closes idle ones, and ends busy ones after their answer; a request
   whose body has not all arrived is answered ``503 shutting_down`` at once,
   `app.server.protocol`; a keep-alive stream is closed with 1012);
2. wait until the requests already being answered are (``REQUESTS_S`` at most): a write
   answered then is committed before the watch streams end;
3. the watch streams catch up with the store, send what is left and end with
   ``shutting_down`` at the store's revision (`app.watch.stream.Watchers.drain`), so a
   watcher resumes on the restarted SQLite registry without listing again.

Watch streams and keep-alive streams are not requests to wait for here. Each phase's length
is logged (``shutdown phases``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any, Protocol

from app.server.protocol import GuardedProtocol

log = logging.getLogger("app")

# How long the answers in progress at SIGTERM may take before the watch streams end anyway
# (a write held by a stalled store answers 503 at the store's timeout; the streams' drain
# must leave time within uvicorn's 10 s for the connections).
REQUESTS_S = 3.0
POLL_S = 0.01


class _Drains(Protocol):
    def drain(self) -> None: ...


class _Server(Protocol):
    """What is read of uvicorn's ``Server``."""

    servers: list[asyncio.base_events.Server]
    server_state: Any


def _answering(connections: Collection[object], streaming: Collection[object]) -> list[Any]:
    """HTTP connections still answering a request (not a watch stream's, whose transport is
    in ``streaming``): one shut down while idle is closed, one answering closes after it."""
    return [
        c
        for c in connections
        if isinstance(c, GuardedProtocol)  # HTTP (with or without the wire path), not a WebSocket
        and not c.transport.is_closing()
        and c.transport not in streaming
    ]


async def drain(server: _Server, state: Any) -> dict[str, float]:
    """Phases 1-3 of the module's doc; returns each phase's seconds (also logged)."""
    started = time.perf_counter()
    for listening in server.servers:
        listening.close()
    registry: _Drains | None = getattr(state, "registry", None)
    watchers: Any = getattr(state, "watchers", None)
    if registry is not None:
        registry.drain()
    connections = server.server_state.connections
    for connection in list(connections):
        connection.shutdown()
    told = time.perf_counter()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REQUESTS_S
    # Only these are looked at again (keep-alive streams are not: 12,500 of them made each
    # look cost a few ms); no connection is accepted any more.
    answering = _answering(connections, ())
    while answering and loop.time() < deadline:
        streams = {s.transport for s in watchers.open} if watchers is not None else set()
        answering = _answering(answering, streams)
        if answering:
            await asyncio.sleep(POLL_S)
    answered = time.perf_counter()
    if watchers is not None:
        await watchers.drained()
    phases = {
        "connections_s": round(told - started, 3),
        "requests_s": round(answered - told, 3),
        "watch_streams_s": round(time.perf_counter() - answered, 3),
    }
    log.info("shutdown phases", extra=phases | {"still_answering": len(answering)})
    return phases
