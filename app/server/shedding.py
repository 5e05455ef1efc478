"""Shed what can wait, so that a saturated registry still serves heartbeats in time.

The signal is the event loop's sustained lag (``app/store/lease_clock.py``'s ``LoopWatch``: a
timer every 50 ms, the least lateness of its last 4 ticks), which is how long any request
waits before the registry even reads it. Past ``lag_s`` (``REGISTRY_SHED_LAG_S``), or with
``in_flight`` sheddable requests already being answered (``REGISTRY_SHED_IN_FLIGHT``), a
request for one of the ``routes`` (``REGISTRY_SHED_ROUTES``: GET of the status page, /events,
/metrics, the list pages and new watch streams by default) answers ``503 overloaded`` with
``Retry-After`` at once, before any of its work; heartbeats, registrations, opens, handshakes,
engine reads and the health probes are never shed. Each shed request is counted in
``registry_shed_requests_total`` by route.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from starlette.types import Receive, Scope, Send

from app.core.errors import Overloaded
from app.core.metrics import Metrics
from app.core.problems import send_problem
from app.server.settings import Settings
from app.store.lease_clock import CLOCK, loop_watch


class Shedder:
    def __init__(
        self, lag_s: float, in_flight: int, retry_after_s: int, routes: tuple[str, ...]
    ) -> None:
        self.lag_s = lag_s
        self.in_flight = in_flight
        self.retry_after = str(max(1, retry_after_s)).encode()
        self.routes = frozenset(routes)
        self.busy = 0  # sheddable requests being answered (watch streams not counted)
        self._counters: dict[str, Any] = {}

    def sheddable(self, scope: Scope) -> bool:
        return scope["method"] == "GET" and scope["path"] in self.routes

    def overloaded(self) -> str | None:
        """Why a sheddable request is shed now (None: it is served)."""
        if self.in_flight and self.busy >= self.in_flight:
            return f"{self.busy} reads are being answered (REGISTRY_SHED_IN_FLIGHT)"
        if self.lag_s > 0:
            lag = loop_watch().lag_now()
            if lag > self.lag_s:
                return f"its event loop lags {lag * 1000:.0f} ms (REGISTRY_SHED_LAG_S)"
        return None

    async def shed(self, scope: Scope, send: Send, why: str, metrics: Metrics) -> None:
        path = scope["path"]
        counter = self._counters.get(path)
        if counter is None:
            counter = self._counters[path] = metrics.shed.labels(path)
        counter.inc()
        scope["route"] = SimpleNamespace(path=path)  # counted by its path, as a route is
        problem = Overloaded(
            f"The registry is saturated ({why}) and serves heartbeats, registrations and "
            f"handshakes first; retry this {path} after Retry-After seconds.",
        )
        await send_problem(send, problem, scope, [(b"retry-after", self.retry_after)])

    async def serve(
        self, scope: Scope, receive: Receive, send: Send, app: Any, metrics: Metrics
    ) -> None:
        """Answer a sheddable request: shed it, or serve it counted as busy."""
        why = self.overloaded()
        if why is not None:
            await self.shed(scope, send, why, metrics)
            return
        stream = b"watch" in scope["query_string"]
        if not stream:
            self.busy += 1
        try:
            await app(scope, receive, send)
        finally:
            if not stream:
                self.busy -= 1


def install(app: Any, settings: Settings) -> None:
    """The process's lease clock and the app's shedder, from the settings (``serve``)."""
    CLOCK.grace_s, CLOCK.stall_s = settings.lease_grace_s, settings.loop_stall_s
    routes = tuple(r.strip() for r in settings.shed_routes.split(",") if r.strip())
    app.state.shedder = Shedder(
        settings.shed_lag_s, settings.shed_in_flight, settings.shed_retry_after_s, routes
    )


def shedder_of(scope: Scope) -> Shedder | None:
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "shedder", None)
