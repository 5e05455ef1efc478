"""The one back-off policy (registry_client/backoff.py): its bounds, full jitter's spread, the
deadline and the `Retry-After` floor, on a fake clock and seeded draws."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from registry_client.backoff import Backoff, retry_after

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_pause_is_under_its_doubling_ceiling_and_the_cap() -> None:
    backoff = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(1))
    ceilings, pauses = [], []
    for _ in range(8):
        ceilings.append(backoff.ceiling())
        pauses.append(backoff.next())
    assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0])
    assert all(0 <= p < c for p, c in zip(pauses, ceilings, strict=True))


def test_reset_starts_from_the_base_again() -> None:
    backoff = Backoff(base_s=0.1, cap_s=5.0)
    for _ in range(5):
        backoff.next()
    assert backoff.ceiling() == pytest.approx(3.2)
    backoff.reset()
    assert backoff.ceiling() == pytest.approx(0.1)
    assert backoff.tries == 0


def test_many_tries_stay_at_the_cap() -> None:
    backoff = Backoff(base_s=0.5, cap_s=8.0, rng=random.Random(2))
    assert all(backoff.next() < 8.0 for _ in range(200))  # 2**200 never overflows it
    assert backoff.ceiling() == 8.0


def test_full_jitter_spreads_a_thousand_clients_over_the_whole_window() -> None:
    """A thousand clients that failed at the same moment: their first pauses cover [0, base)
    evenly, not one instant (what the watch's reconnect relies on)."""
    rng = random.Random(3)
    pauses = [Backoff(base_s=2.0, cap_s=16.0, rng=rng).next() for _ in range(1000)]
    assert all(0 <= p < 2.0 for p in pauses)
    tenths = Counter(int(p / 0.2) for p in pauses)
    assert len(tenths) == 10
    assert max(tenths.values()) < 150  # about 100 a tenth
    assert len({round(p, 6) for p in pauses}) > 990


def test_the_deadline_bounds_every_pause_and_says_when_it_passed() -> None:
    clock = Clock()
    backoff = Backoff(base_s=1.0, cap_s=10.0, deadline_s=5.0, clock=clock, rng=random.Random(4))
    first = backoff.next()
    assert not backoff.expired
    clock.now += 4.5
    assert backoff.next(retry_after_s=30.0) == pytest.approx(0.5)  # never past the deadline
    clock.now += 0.5
    assert backoff.expired
    assert backoff.next() == 0.0
    assert first < 1.0
    backoff.reset()  # a success: a new deadline from now
    assert not backoff.expired


def test_retry_after_is_a_floor_not_a_cap() -> None:
    backoff = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(5))
    assert backoff.next(retry_after_s=3.0) == 3.0  # above the cap: the server's word wins
    assert backoff.next(retry_after_s=0.0) < 0.2  # below the draw: the draw


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("3", 3.0),
        (" 1.5 ", 1.5),
        ("0", 0.0),
        (None, None),
        ("soon", None),
        ("-1", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", None),
        ("86400", None),
    ],
)
def test_retry_after_parses_delta_seconds_only(header: str | None, seconds: float | None) -> None:
    assert retry_after(header) == seconds


def test_a_bad_policy_is_refused_naming_its_values() -> None:
    with pytest.raises(ValueError, match="base_s=0"):
        Backoff(base_s=0, cap_s=1.0)
    with pytest.raises(ValueError, match=r"cap_s=0\.5"):
        Backoff(base_s=1.0, cap_s=0.5)
