"""A call repeated every few seconds while the app serves (the tokens file's watch, the heap's
freezing): one task, cancelled and awaited on leaving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any


@contextlib.asynccontextmanager
async def every(seconds: float, call: Callable[[], Any], name: str) -> AsyncIterator[None]:
    async def run() -> None:
        while True:
            await asyncio.sleep(seconds)
            call()

    task = asyncio.create_task(run(), name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
