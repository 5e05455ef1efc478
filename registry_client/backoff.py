"""The one back-off policy of every client loop (torch-free, no I/O of its own).

Capped exponential with full jitter: the n-th pause is drawn uniformly from
``[0, min(cap_s, base_s * 2**n))``, so a thousand clients that lost the same replica in the
same second come back spread over the whole window instead of in one burst (the AWS
architecture note "Exponential Backoff And Jitter" measured full jitter as the cheapest for
the server). A server's ``Retry-After`` is a floor for the next pause. ``reset()`` after a
success starts the sequence again; ``deadline_s`` (optional) bounds the whole sequence:
``expired`` says when it has passed, and no pause runs past it.

Used by the watch (`registry_client.watch`), the decode side's release follower
(`workers.vllm_plugin.release`), router-sync, ``engine-registry status --watch``, and the
service's own watch feed (`app.watch.feed`): the one module of ``workers`` the service imports,
so it imports nothing but the standard library (`tests/test_require_all.py` checks).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


class Backoff:
    """Pauses between tries: ``pause = backoff.next()`` then sleep it; ``reset()`` on
    success."""

    def __init__(
        self,
        *,
        base_s: float = 0.1,
        cap_s: float = 5.0,
        deadline_s: float | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"need 0 < base_s <= cap_s (base_s={base_s}, cap_s={cap_s})")
        self.base_s = base_s
        self.cap_s = cap_s
        self.deadline_s = deadline_s
        self._rng = rng or random.Random()
        self._clock = clock
        self.tries = 0
        self._started = clock()

    def reset(self) -> None:
        """A success: the next failure starts from ``base_s`` again (and a new deadline)."""
        self.tries = 0
        self._started = self._clock()

    @property
    def expired(self) -> bool:
        """Whether ``deadline_s`` has passed since the first failure after the last reset."""
        return self.deadline_s is not None and self._clock() - self._started >= self.deadline_s

    def ceiling(self) -> float:
        """The upper bound of the next pause (before ``Retry-After``)."""
        return min(self.cap_s, self.base_s * float(2 ** min(self.tries, 62)))

    def next(self, retry_after_s: float | None = None) -> float:
        """The next pause in seconds: full jitter under the current ceiling, at least
        ``retry_after_s`` (a server's ``Retry-After``), never past the deadline."""
        if self.tries == 0:
            self._started = self._clock()
        pause = self._rng.uniform(0.0, self.ceiling())
        self.tries += 1
        if retry_after_s is not None and retry_after_s > pause:
            pause = retry_after_s
        if self.deadline_s is not None:
            left = self.deadline_s - (self._clock() - self._started)
            pause = max(0.0, min(pause, left))
        return pause


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds (the delta-seconds form; an HTTP date or
    garbage gives None)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 3600 else None
