"""A call repeated every few seconds while the app serves (the tokens file's watch, the heap's
freezing): one task, cancelled and awaited on leaving.

A call that raises is logged and the task goes on: one failure must not end a watch for good
(a tokens file no longer checked would keep a revoked token in force until a restart). The
first failure of a run is logged with its traceback; the next ones of the same run only when
the call succeeds again, as a count, so a call that keeps failing logs once, not every period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger("app")


@contextlib.asynccontextmanager
async def every(seconds: float, call: Callable[[], Any], name: str) -> AsyncIterator[None]:
    async def run() -> None:
        failed = 0  # failures in a row
        while True:
            await asyncio.sleep(seconds)
            try:
                call()
            except Exception:
                failed += 1
                if failed == 1:
                    log.exception(
                        f"periodic task {name} failed; retried every {seconds:g} s",
                        extra={"task": name},
                    )
                continue
            if failed:
                log.warning(
                    f"periodic task {name} succeeded again after {failed} failures",
                    extra={"task": name, "failures": failed},
                )
                failed = 0

    task = asyncio.create_task(run(), name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
