"""``python -m bench.fleet_reads URL``: an operator's reads of a fleet, from a process of their
own (``bench/fleet.py`` runs it after the steady state): three pages of 500 groups
(``GET /tp-groups``, following ``continue``), the same walk again (a list page keeps each
group's view once made: ``app/watch/rendered.py``, so a second walk shows what an operator's
next look costs), then the status page and a scrape of ``/metrics``, each twice (both read
every group, each group's state kept per version after the first read:
``app/registry/kept_states.py``). Prints one JSON object.

A process of its own, as an operator's curl or browser is: made from a thread of the load
client (one asyncio loop driving 12,500 nodes' heartbeats), the first page's figure carried
that process's own delays. At 100,000 ranks the client saw the first page in 180-416 ms in
four tries while the registry's own histogram (``registry_http_request_duration_seconds``)
counted each of those requests under 100 ms.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx


def _timed_get(c: httpx.Client, path: str, **params: Any) -> tuple[float, httpx.Response]:
    t = time.perf_counter()
    r = c.get(path, params=params)
    return time.perf_counter() - t, r


def _walk(c: httpx.Client, pages: int) -> tuple[list[float], int]:
    """The first ``pages`` pages of 500 groups: their times and the largest page's bytes."""
    times, size = [], 0
    params: dict[str, Any] = {"limit": 500}
    for _ in range(pages):
        dt, r = _timed_get(c, "/tp-groups", **params)
        r.raise_for_status()
        times.append(dt)
        size = max(size, len(r.content))
        token = r.json()["continue"]
        if token is None:
            break
        params["continue"] = token
    return times, size


def reads(url: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=120) as c:
        times, size = _walk(c, 3)
        again, _ = _walk(c, 3)
        status_dt, status = _timed_get(c, "/status")
        status_again, _ = _timed_get(c, "/status")
        metrics = [_timed_get(c, "/metrics")[0] for _ in range(2)]
    return {
        "page_500_ms": [round(t * 1000, 1) for t in times],
        "page_500_again_ms": [round(t * 1000, 1) for t in again],
        "page_500_kib": round(size / 1024, 1),
        "status_ms": round(status_dt * 1000, 1),
        "status_kib": round(len(status.content) / 1024, 1),
        "status_code": status.status_code,
        "status_again_ms": round(status_again * 1000, 1),
        "metrics_ms": [round(t * 1000, 1) for t in metrics],
    }


if __name__ == "__main__":
    print(json.dumps(reads(sys.argv[1])))
