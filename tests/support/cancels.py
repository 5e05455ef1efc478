"""A stream that loses a cancellation, as Python 3.11's ``asyncio.wait_for`` can (CPython
gh-86296): for tests of what must still end (``app/store/tasks.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any


def losing_first_cancel(
    real: Callable[..., AsyncIterator[Any]], lost: list[bool]
) -> Callable[..., AsyncIterator[Any]]:
    """``real``'s stream, except that the first cancellation that reaches it while it waits is
    lost (noted in ``lost``): it goes on waiting for an item that never comes, and only a second
    cancellation ends it."""

    async def lossy(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stream = real(*args, **kwargs)
        while True:
            try:
                item = await anext(stream)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(True)
                await asyncio.Event().wait()  # nothing comes: only a second cancel ends it
            yield item

    return lossy
