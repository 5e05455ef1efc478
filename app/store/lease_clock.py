"""When a lease's clock runs: a renewal is judged at its arrival, and not during the
registry's own stalls.

A lapse must mean the rank stopped renewing, never that the registry was too slow to serve
its renewal. Two rules make it so, on the embedded store and on etcd (where etcd keeps each
lease ``grace_s`` past its ttl and the replica renewing it applies them: ``etcd/reaper.py``):

- **Arrival.** The edge stamps each request when its head is read (``ARRIVED``, a context
  variable of the request's task) and holds heartbeats in ``IN_FLIGHT`` until answered. A
  renewal, and the reads it makes, judge a lease's expiry at that instant, so a heartbeat that
  reached the registry before its lease ran out renews it however long it then waited for the
  loop; the sweeper purges only leases that expired before the oldest heartbeat still in
  flight arrived (at most ``grace_s`` back).
- **Stalls.** A timer on the event loop (``LoopWatch``, every ``TICK_S``) notes when the loop
  last ran. A gap longer than ``stall_s`` between two ticks (the process stopped, or starved,
  or one callback held the loop: a heartbeat sent then waited in the kernel) is a stall:
  every lease live when it began gets the stall's length added to its expiry, at most
  ``grace_s`` in all since the lease's last renewal. A loop that keeps lagging is one too:
  the lateness of ticks later than ``LAG_FLOOR_S`` adds up, and every ``stall_s`` of it is
  credited as a stall. A restart is a stall too: the time since
  the file's latest renewal. The gap is found by the timer or by the first lease judgement
  after it, whichever runs first, so a heartbeat queued during the stall is judged after the
  credit.

A dead rank is therefore found within its ttl plus ``grace_s`` at most, and only when the
registry itself stalled; otherwise within its ttl, as before.

Every instant here is on the process's monotonic clock (``now``), never the wall clock: a
step of the wall clock (NTP, a VM resumed, an operator's ``date``) moves no lease. Wall time
is only what a file persists (``to_wall``, ``from_wall``).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

# When the request being served reached the registry (``now()``); None outside requests.
ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("arrived", default=None)

TICK_S = 0.05  # the loop watch's period
SUSTAINED = 4  # ticks: the shedding signal is the loop's lag over all of them
LAG_FLOOR_S = 0.1  # a tick later than this: the loop lags, and renewals wait that long


def now() -> float:
    """The leases' clock: monotonic, so a step of the wall clock moves no lease."""
    return time.monotonic()


def to_wall(at: float) -> float:
    """An instant of the leases' clock as wall time (to persist it)."""
    return at + time.time() - time.monotonic()


def from_wall(at: float) -> float:
    """A persisted wall time as an instant of the leases' clock."""
    return at - time.time() + time.monotonic()


@dataclass
class LeaseClock:
    """The process's lease clock settings (``serve`` sets them from REGISTRY_*)."""

    grace_s: float = 60.0  # most a lease's expiry moves for stalls since its last renewal
    stall_s: float = 1.0  # a gap in the loop longer than this is a stall
    etcd_window_s: float = 0.0  # etcd: a lease's TTL past ttl + grace (``etcd/journal.py``)


CLOCK = LeaseClock()


@dataclass(slots=True)
class StoredLease:
    ttl_s: int
    expires_at: float
    keys: set[str] = field(default_factory=set)
    grace: float = 0.0  # added to expires_at for stalls since the last renewal


class InFlight:
    """Heartbeats received and not yet answered, by arrival (oldest first: dict order)."""

    def __init__(self) -> None:
        self._arrivals: dict[int, float] = {}
        self._ids = itertools.count()

    def begin(self, arrived: float) -> int:
        token = next(self._ids)
        self._arrivals[token] = arrived
        return token

    def end(self, token: int) -> None:
        self._arrivals.pop(token, None)

    def oldest(self) -> float | None:
        for arrived in self._arrivals.values():
            return arrived
        return None

    def __len__(self) -> int:
        return len(self._arrivals)


IN_FLIGHT = InFlight()


class LoopWatch:
    """A timer on the running loop: its lateness is the loop's lag (the shedding signal) and
    a gap past ``CLOCK.stall_s`` is a stall (the lease grace). One a loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lag = 0.0  # the last tick's lateness, seconds
        self.lags: deque[float] = deque([0.0] * SUSTAINED, maxlen=SUSTAINED)  # the last ones
        self.stalls: deque[tuple[float, float]] = deque(maxlen=64)  # (began, seconds)
        self.count = 0  # stalls seen in all
        self._last = time.monotonic()  # the loop last seen running: ``late`` checks it
        self._due = self._last + TICK_S
        self._owed = 0.0  # lateness of ticks past LAG_FLOOR_S not yet credited as a stall
        self._owed_since = 0.0
        self._handle = loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        self.lag = max(0.0, now - self._due)
        self.lags.append(self.lag)
        if not self.note(now) and self.lag > LAG_FLOOR_S:  # a lagging loop, not one gap
            if not self._owed:
                self._owed_since = now - self.lag
            self._owed += self.lag
            if self._owed > CLOCK.stall_s:
                self._stall(self._owed_since, self._owed)
                self._owed = 0.0
        self._due = now + TICK_S
        self._handle = self.loop.call_later(TICK_S, self._tick)

    def lag_now(self) -> float:
        """The loop's sustained lag: the least lateness of the last ``SUSTAINED`` ticks (one
        hiccup, a collection or a descheduled moment, is not saturation)."""
        return min(self.lags)

    def note(self, now: float | None = None) -> bool:
        """The loop runs now: a gap since it was last seen running past the threshold is a
        stall (True: one was)."""
        now = time.monotonic() if now is None else now
        gap, self._last = now - self._last, now
        if gap > CLOCK.stall_s:
            self._stall(now - gap, gap)
            return True
        return False

    def _stall(self, began: float, seconds: float) -> None:
        self.stalls.append((began, seconds))
        self.count += 1

    def late(self, now: float) -> bool:
        """Whether the timer is late past a stall at ``now`` (then ``note`` it)."""
        return now - self._last > CLOCK.stall_s + TICK_S

    def since(self, seen: int) -> Iterator[tuple[float, float]]:
        """The stalls after the first ``seen`` (the oldest kept, if more were lost)."""
        new = min(self.count - seen, len(self.stalls))
        yield from itertools.islice(self.stalls, len(self.stalls) - new, None)

    def close(self) -> None:
        self._handle.cancel()


_WATCHES: dict[asyncio.AbstractEventLoop, LoopWatch] = {}


def loop_watch() -> LoopWatch:
    """The running loop's watch, started on first use."""
    loop = asyncio.get_running_loop()
    watch = _WATCHES.get(loop)
    if watch is None or watch.loop.is_closed():
        for old in [w for w in _WATCHES.values() if w.loop.is_closed()]:
            del _WATCHES[old.loop]
        watch = _WATCHES[loop] = LoopWatch(loop)
    return watch


class Credits:
    """The running loop's stalls credited to one set of leases, each stall once."""

    def __init__(self) -> None:
        self.watch: LoopWatch | None = None  # the loop's (``loop_watch``), kept
        self.seen = -1  # the watch's stalls credited already; -1: none looked at yet

    def due(self, now: float) -> bool:
        """Whether a stall may be owed at ``now`` (then ``credit``)."""
        watch = self.watch
        return watch is None or watch.late(now) or self.seen != watch.count

    def credit(self, leases: dict[int, StoredLease]) -> bool:
        """Credit the stalls not yet credited to every lease live when each began; whether
        any lease moved."""
        watch = self.watch
        if watch is None or watch.loop.is_closed():
            watch = self.watch = loop_watch()
        watch.note()
        if self.seen == watch.count:
            return False
        seen, self.seen = self.seen, watch.count
        return seen >= 0 and any([extend(leases, *stall) for stall in watch.since(seen)])


def extend(leases: dict[int, StoredLease], began: float, seconds: float) -> int:
    """Every lease live at ``began`` gets ``seconds`` more (within ``CLOCK.grace_s`` since its
    last renewal); how many moved."""
    moved = 0
    for lease in leases.values():
        if lease.expires_at > began and lease.grace < CLOCK.grace_s:
            more = min(seconds, CLOCK.grace_s - lease.grace)
            lease.expires_at += more
            lease.grace += more
            moved += 1
    return moved


def expiry_heap(leases: dict[int, StoredLease]) -> list[tuple[float, int]]:
    heap = [(lease.expires_at, i) for i, lease in leases.items()]
    heapq.heapify(heap)
    return heap


def last_served(leases: dict[int, StoredLease]) -> float | None:
    """When the store last renewed or granted a lease, as its persisted expiries tell."""
    return max((lease.expires_at - lease.ttl_s for lease in leases.values()), default=None)


def sweep_cutoff(now: float) -> float:
    """Leases that expired before this instant may go: none a heartbeat in flight reached in
    time (bounded by ``CLOCK.grace_s``)."""
    oldest = IN_FLIGHT.oldest()
    return now if oldest is None else max(min(now, oldest), now - CLOCK.grace_s)
