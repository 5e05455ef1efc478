"""A prefix read from etcd in pages: one answer for a whole fleet's records (15 MiB at 10,000
ranks of 80 KV regions) passes gRPC's 16 MiB cap on a message and fails, so a prefix is read
``RANGE_PAGE`` keys at a time, the later pages at the first page's revision (one snapshot)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
from aetcd import rpc

# Keys a Range answers at most (later pages follow): an agent's record is about 1.5 KiB with
# 80 KV regions, so a page stays near 1.5 MiB, far below gRPC's 16 MiB cap on an answer.
RANGE_PAGE = 1000

Send = Callable[[aetcd.Client, float], Awaitable[Any]]
Call = Callable[[str, Send], Awaitable[Any]]


def first_page(key: bytes, end: bytes) -> Any:
    """The request of a prefix's first page (a single key, ``end`` empty, has no page)."""
    return rpc.RangeRequest(key=key, range_end=end, limit=RANGE_PAGE if end else 0)


async def rest(call: Call, reply: Any, end: bytes) -> tuple[list[Any], int]:
    """Every key of the prefix whose first page is ``reply``, and its revision."""
    kvs, revision = list(reply.kvs), int(reply.header.revision)
    while reply.more:
        request = rpc.RangeRequest(
            key=kvs[-1].key + b"\0", range_end=end, limit=RANGE_PAGE, revision=revision
        )
        reply = await call("read", _ranged(request))
        kvs.extend(reply.kvs)
    return kvs, revision


def _ranged(request: Any) -> Send:
    def send(client: aetcd.Client, seconds: float) -> Awaitable[Any]:
        reply: Awaitable[Any] = client.kvstub.Range(request, timeout=seconds)
        return reply

    return send
