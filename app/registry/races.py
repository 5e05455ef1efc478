"""The one compare-and-set retry loop: every change to a group is a store transaction guarded
by a revision the writer read; losing the race is a return value, and the loser re-reads and
tries again, a bounded number of times."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TypeVar

from app.core.errors import StoreUnavailable

# Optimistic transactions retry this often before giving up with 503 (never reached in
# practice: each retry means another writer made progress).
MAX_ATTEMPTS = 200

T = TypeVar("T")


class Lost(enum.Enum):
    """What an attempt returns when its transaction's compares failed."""

    RACE = enum.auto()


LOST = Lost.RACE


async def until_won(attempt: Callable[[], Awaitable[T | Lost]], what: str) -> T:
    """Run ``attempt`` (read, decide, one transaction) until it returns anything but
    ``LOST``; ``StoreUnavailable`` naming ``what`` after ``MAX_ATTEMPTS`` lost races. What an
    attempt raises (a refusal, the store unavailable) ends the loop as it is."""
    for _ in range(MAX_ATTEMPTS):
        outcome = await attempt()
        if not isinstance(outcome, Lost):
            return outcome
    raise StoreUnavailable(f"{what} lost too many races.")
