"""Ending a background task that must end: cancelled, and cancelled again while it goes on,
within a deadline.

On Python 3.11 ``asyncio.wait_for`` loses a cancellation that arrives as the call it waits
for completes (CPython gh-86296, fixed in 3.12): the task goes on with the call's result as
if never cancelled. A task that loops on ``wait_for`` over a stream that never ends (the watch
feed following the store, a watch hub's broadcaster) then never ends, and a plain
``task.cancel(); await task`` at shutdown waits for it forever: a registry on etcd, whose
renewal journal writes every tick, was seen to hang so in 4 of about 30 shutdowns of an
in-process benchmark (``bench/wire_cost.py --store etcd``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("app")

STOP_S = 5.0  # the most ``stop`` waits for a task to end
AGAIN_S = 0.5  # a task still running this long after a cancellation is cancelled again


async def stop(task: asyncio.Task[Any], deadline_s: float = STOP_S) -> bool:
    """Cancel ``task`` and wait for it to end, cancelling it again every ``AGAIN_S`` while it
    goes on, for ``deadline_s`` at most: whether it ended (else it is logged and left). What
    it raised is retrieved, not raised here."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    while not task.done():
        left = until - loop.time()
        if left <= 0:
            log.error(
                "a background task did not end within %g s of its cancellation; left running",
                deadline_s,
                extra={"task": task.get_name()},
            )
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(AGAIN_S, left))
    if not task.cancelled():
        task.exception()  # retrieved: the task's own logging said what failed
    return True
