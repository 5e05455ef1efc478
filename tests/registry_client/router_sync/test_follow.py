"""router-sync's watch loop (`registry_client.router_sync.sync.follow`) retries on the one back-off
policy
(`registry_client.backoff.Backoff`: full jitter, capped, a server's ``Retry-After`` as a floor), not
on a fixed pause; and `Groups` knows since when the watch is blind, and why."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from registry_client.backoff import Backoff
from registry_client.errors import RegistryUnavailable, Unauthorized
from registry_client.router_sync.offers import Groups
from registry_client.router_sync.sync import follow
from registry_client.watch import WatchEvent

pytestmark = pytest.mark.unit


class Stop(threading.Event):
    """Records each pause asked of it; set after ``after`` of them."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.pauses: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.pauses.append(timeout)
        if len(self.pauses) >= self.after:
            self.set()
        return self.is_set()


class Refusing:
    """A client whose watch fails with each of ``errors`` in turn, then lists nothing."""

    url = "http://registry"

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors

    def watch(self, **_: Any) -> Iterator[WatchEvent]:
        if self.errors:
            raise self.errors.pop(0)
        yield WatchEvent("SYNC", 7, groups=[])


def lost() -> RegistryUnavailable:
    return RegistryUnavailable("no registry answered", urls=["http://registry"], attempts=3)


def test_retries_are_jittered_and_capped_not_a_fixed_pause() -> None:
    stop = Stop(after=8)
    follow(
        Refusing([lost() for _ in range(8)]),
        Groups(),
        stop,
        Backoff(base_s=0.5, cap_s=10.0, rng=random.Random(1)),
    )
    expected = Backoff(base_s=0.5, cap_s=10.0, rng=random.Random(1))
    assert stop.pauses == [expected.next() for _ in range(8)]
    assert len(set(stop.pauses)) == 8
    assert all(0 <= p <= 10.0 for p in stop.pauses)


def test_a_retry_after_the_error_carries_is_a_floor() -> None:
    refused = Unauthorized({"code": "unauthorized"}, status=401)
    refused.retry_after_s = 7.0  # type: ignore[attr-defined]
    stop = Stop(after=1)
    follow(Refusing([refused]), Groups(), stop, Backoff(base_s=0.5, cap_s=10.0))
    assert stop.pauses[0] >= 7.0


def test_a_failure_says_what_routers_keep_within_and_past_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    groups = Groups(clock=lambda: now[0])
    groups.apply(WatchEvent("SYNC", 3, groups=[]))
    now[0] = 110.0
    with caplog.at_level(logging.WARNING, logger="engine_registry.router_sync"):
        follow(Refusing([lost()]), groups, Stop(after=1), Backoff(base_s=0.5, cap_s=10.0))
        now[0] = 145.0  # 45 s blind: past the 30 s grace
        follow(Refusing([lost()]), groups, Stop(after=1), Backoff(base_s=0.5, cap_s=10.0))
    within, past = (r.getMessage() for r in caplog.records)
    assert "routers keep the last list for 20 s more" in within, within
    assert "keep the last list" not in past, past
    assert "blind 45 s, over the 30 s grace: nothing is offered" in past, past
    assert "past the" not in past, past  # the blind line itself is said once, by Sight


def test_groups_say_since_when_the_watch_is_blind_and_why() -> None:
    now = [100.0]
    groups = Groups(clock=lambda: now[0])
    groups.apply(WatchEvent("SYNC", 3, groups=[]))
    now[0] = 112.0
    groups.failed("401 unauthorized: rotated")
    assert groups.blind() == (12.0, "401 unauthorized: rotated")
    groups.apply(WatchEvent("BOOKMARK", 4))  # a bookmark is word from the registry
    assert groups.blind() == (0.0, "")


def test_a_round_on_unchanged_groups_sends_the_same_list_without_working_it_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import registry_client.router_sync.sync as router_sync

    calls: list[int] = []

    def counted(engines: Any, model: str | None = None) -> tuple[list[Any], dict[str, str]]:
        calls.append(1)
        return [], {}

    monkeypatch.setattr(router_sync, "offer", counted)
    groups = Groups()
    groups.apply(WatchEvent("SYNC", 3, groups=[]))
    announcer = router_sync.Announcer([], None)
    for _ in range(3):
        announcer.round(*reversed(groups.versioned()))
    assert len(calls) == 1  # 12,500 instances: 0.8 s each round before
    groups.apply(WatchEvent("BOOKMARK", 4))  # not a change of the groups
    announcer.round(*reversed(groups.versioned()))
    assert len(calls) == 1
    groups.apply(WatchEvent("DELETED", 5, engine=None))
    announcer.round(*reversed(groups.versioned()))
    assert len(calls) == 2
