"""Shed what can wait, so that a saturated registry still serves heartbeats in time.

A request for one of the ``routes`` (``REGISTRY_SHED_ROUTES``: GET of the status page, /events,
/metrics, the list pages and new watch streams by default) is a read that can wait:

- **Lag.** The signal is the event loop's sustained lag (``app/store/lease_clock.py``'s
  ``LoopWatch``: a timer every 50 ms, the least lateness of its last 4 ticks), which is how
  long any request waits before the registry even reads it. Past ``lag_s``
  (``REGISTRY_SHED_LAG_S``) such a read answers ``503 overloaded`` with ``Retry-After`` at once,
  before any of its work.
- **Seats.** At most ``in_flight`` (``REGISTRY_SHED_IN_FLIGHT``) such reads are answered at once
  (new watch streams take no seat: a stream's cost is its events). One loop serves everything,
  so more reads at once finish no sooner; they only stretch each turn of the loop that a
  heartbeat waits for (a status page at 100,000 ranks holds it 60-130 ms at a time). A read
  past the seats waits for one in arrival order, at most ``queue_s``
  (``REGISTRY_SHED_QUEUE_S``), then is shed; a seat it gets while the loop lags is given back
  and the read shed.

Heartbeats, registrations, opens, handshakes, engine reads and the health probes are never
shed. Each shed request is counted in ``registry_shed_requests_total`` by route.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
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
        self,
        lag_s: float,
        in_flight: int,
        retry_after_s: int,
        routes: tuple[str, ...],
        queue_s: float = 0.0,
    ) -> None:
        self.lag_s = lag_s
        self.in_flight = in_flight
        self.queue_s = queue_s
        self.retry_after = str(max(1, retry_after_s)).encode()
        self.routes = frozenset(routes)
        self.busy = 0  # sheddable requests being answered (watch streams not counted)
        self._waiting: deque[asyncio.Future[None]] = deque()  # for a seat, in arrival order
        self._counters: dict[str, Any] = {}

    def sheddable(self, scope: Scope) -> bool:
        return scope["method"] == "GET" and scope["path"] in self.routes

    def overloaded(self) -> str | None:
        """Why a sheddable request is shed now, by the loop's lag (None: it may be served)."""
        if self.lag_s > 0:
            lag = loop_watch().lag_now()
            if lag > self.lag_s:
                return f"its event loop lags {lag * 1000:.0f} ms (REGISTRY_SHED_LAG_S)"
        return None

    async def seat(self) -> str | None:
        """Take a seat, waiting in arrival order at most ``queue_s`` (None: taken; else why
        not). The caller gives it back with ``leave``."""
        if not self.in_flight or (self.busy < self.in_flight and not self._waiting):
            self.busy += 1
            return None
        seats = f"{self.in_flight} reads were being answered (REGISTRY_SHED_IN_FLIGHT)"
        if self.queue_s <= 0:
            return seats
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_s)
        except TimeoutError:
            if waiter.done():  # handed a seat as the wait ran out: it is ours
                return None
            self._drop(waiter)
            return f"{seats[:-1]}, for {self.queue_s:g} s: REGISTRY_SHED_QUEUE_S)"
        except asyncio.CancelledError:  # the client went away while it waited
            if waiter.done():
                self.leave()
            else:
                self._drop(waiter)
            raise
        return None  # ``leave`` handed its seat over (``busy`` unchanged)

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiting.remove(waiter)

    def leave(self) -> None:
        """Give a seat back: to the longest waiter still waiting, else free it."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the seat passes over: ``busy`` unchanged
                return
        self.busy -= 1

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
        if b"watch" in scope["query_string"]:  # a stream takes no seat
            await app(scope, receive, send)
            return
        why = await self.seat()
        if why is None and (why := self.overloaded()) is not None:  # lagging since it came
            self.leave()
        if why is not None:
            await self.shed(scope, send, why, metrics)
            return
        try:
            await app(scope, receive, send)
        finally:
            self.leave()


def install(app: Any, settings: Settings) -> None:
    """The process's lease clock and the app's shedder, from the settings (``serve``)."""
    CLOCK.grace_s, CLOCK.stall_s = settings.lease_grace_s, settings.loop_stall_s
    CLOCK.etcd_window_s = settings.etcd_renew_window_s
    routes = tuple(r.strip() for r in settings.shed_routes.split(",") if r.strip())
    app.state.shedder = Shedder(
        settings.shed_lag_s,
        settings.shed_in_flight,
        settings.shed_retry_after_s,
        routes,
        settings.shed_queue_s,
    )


def shedder_of(scope: Scope) -> Shedder | None:
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "shedder", None)
