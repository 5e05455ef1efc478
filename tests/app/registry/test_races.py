"""The registry's one compare-and-set retry loop (``app.registry.races``): lost races are
retried a bounded number of times, and no other module of the domain writes the loop again."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

import app.registry
from app.core.errors import StoreUnavailable
from app.registry.races import LOST, MAX_ATTEMPTS, Lost, until_won

pytestmark = pytest.mark.unit

REGISTRY = Path(app.registry.__file__).parent


def test_an_attempt_that_loses_is_run_again_until_it_wins() -> None:
    tries: list[int] = []

    async def attempt() -> str | Lost:
        tries.append(len(tries))
        return LOST if len(tries) < 3 else "won"

    assert asyncio.run(until_won(attempt, "Opening")) == "won"
    assert len(tries) == 3


def test_an_attempt_that_answers_none_ends_the_loop() -> None:
    tries: list[int] = []

    async def attempt() -> Lost | None:
        tries.append(1)
        return None

    assert asyncio.run(until_won(attempt, "Deleting")) is None
    assert tries == [1]


def test_losing_every_race_is_a_503_naming_the_change_after_max_attempts() -> None:
    tries: list[int] = []

    async def attempt() -> Lost:
        tries.append(1)
        return LOST

    with pytest.raises(StoreUnavailable, match=r"^Deleting group 'g' lost too many races\.$"):
        asyncio.run(until_won(attempt, "Deleting group 'g'"))
    assert len(tries) == MAX_ATTEMPTS


def test_a_refusal_ends_the_loop_as_it_is() -> None:
    async def attempt() -> Lost:
        raise KeyError("refused")

    with pytest.raises(KeyError):
        asyncio.run(until_won(attempt, "Registering"))


def test_no_module_of_the_domain_writes_the_retry_loop_again() -> None:
    loops = re.compile(r"range\(MAX_ATTEMPTS\)|lost too many races")
    again = [
        f"{path.name}:{n}"
        for path in sorted(REGISTRY.glob("*.py"))
        if path.name != "races.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if loops.search(line)
    ]
    assert not again, f"compare-and-set loops outside app/registry/races.py: {again}"
