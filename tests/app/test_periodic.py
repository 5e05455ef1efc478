"""app/core/periodic.py: a periodic task whose call raises logs it and goes on calling (the
tokens file's watch must outlive one failed check); a run of failures logs once, with its
traceback, and once more, as a count, when the call succeeds again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from app.core.periodic import every

pytestmark = pytest.mark.unit


def test_a_periodic_task_logs_a_failure_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def call() -> None:
        calls.append(len(calls))
        if len(calls) in (1, 2, 3):  # three failures in a row, then it succeeds
            raise RuntimeError("Cannot change state of finished Timeout")

    async def scenario() -> None:
        async with every(0.01, call, "test-periodic"):
            for _ in range(500):  # bounded: 5 s at most
                if len(calls) >= 6:
                    break
                await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO, logger="app"):
        asyncio.run(scenario())
    assert len(calls) >= 6, calls  # it went on calling after the failures
    failed = [r for r in caplog.records if "test-periodic failed" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]
    assert failed[0].levelno == logging.ERROR
    assert failed[0].exc_info is not None
    assert "finished Timeout" in str(failed[0].exc_info[1])
    again = [r for r in caplog.records if "succeeded again after 3 failures" in r.getMessage()]
    assert len(again) == 1, [r.getMessage() for r in caplog.records]
