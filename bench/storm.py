"""Launch storm: G groups x TP ranks doing the whole protocol at once over real HTTP.

Half the groups are prefill, half decode (TP 8 each, decode group i pairs with prefill group
i). Every rank is one coroutine of one aiohttp client process (the server runs in its own):

1. rank 0 opens the engine (``PUT /tp-groups/{g}/engine``); the other ranks wait for its
   broadcast (an in-process event, as torch.distributed would carry it), then fetch and
   cross-verify the engine (``GET /tp-groups/{g}/engine``);
2. every rank registers its agent (``PUT …/agents/{rank}``) with a metadata blob of 4 KiB to
   256 KiB (log-uniform, fixed seed) and starts heartbeating (every ``HEARTBEAT_S``, a third
   of its ``TTL_S``, the first at a random phase);
3. every decode rank resolves its prefill group (``GET …/engine?wait_ready=30``, held until
   ready) and asks for its handshake plan (``POST /engines/{id}/handshake``).

The storm is over when every handshake has answered 200. "Ranks/s to ready" counts every
rank over the time until the last group became ready (its last registration answered).
Since every rank arrives at once, a request's latency is mostly its wait in the queue; a
paced row (1,024 ranks, groups launching evenly over ``PACED_S``) shows per-operation latency
when the offered load stays below what the service sustains.

Baselines in the same run:

- **etcd direct** (aetcd, a gRPC client, the one the etcd store uses): rank 0 puts the engine
  key, the others get it; every rank grants a lease and puts its blob on it; heartbeats renew
  the lease; every decode rank gets its target blob once the prefill group is complete, the
  readiness signalled in-process for free (what NIXL's etcd metadata exchange does: put per
  agent, get per handshake, nothing checked);
- **ceilings**: a bare ASGI app (the aiohttp client's own ceiling) and a minimal FastAPI app,
  both under the registry's uvicorn settings, loaded with aiohttp and with wrk.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.baselines import ceilings, etcd_storm
from bench.common import (
    registry_server,
    say,
)
from bench.storm_core import (
    HEARTBEAT_S,
    PACED_S,
    TP,
)
from bench.storm_http import http_storm

# -- the whole question --------------------------------------------------------------------------


def _etcd_rows(sizes: list[int], results: dict[str, Any], tmp: Path, note: list[str]) -> None:
    from bench.common import etcd_store_available
    from harness.etcd import EtcdCluster, etcd_available

    if not etcd_available():
        note.append("etcd rows skipped: no etcd binary")
        return
    with EtcdCluster(tmp / "etcd", size=1) as cluster:
        endpoint = cluster.endpoints[0]
        for n in sizes:
            say(f"  etcd direct (aetcd), {n} ranks")
            results["etcd_direct"][str(n)] = _guarded(partial(etcd_storm, endpoint, n))
        ok, why = etcd_store_available()
        if not ok:
            note.append(f"registry-on-etcd rows skipped: {why}")
            return
        for n in sizes:
            say(f"  registry on etcd, {n} ranks")
            url = cluster.url(f"bench-{uuid.uuid4().hex[:8]}")
            with registry_server(url, log=tmp / f"registry-etcd-{n}.log") as http:
                results["registry_etcd"][str(n)] = _guarded(partial(http_storm, http, n))


def _guarded(storm: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one storm; a failure (timeout, refused connections) becomes a row saying so."""
    try:
        row = storm()
    except Exception as exc:  # recorded and reported; the other rows still run
        row = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        say(f"    FAILED: {row['failed']}")
        return row
    _show(row)
    return row


def _show(row: dict[str, Any]) -> None:
    cpu = f", server CPU {row['server_cpu_s']} s" if row.get("server_cpu_s") else ""
    say(
        f"    ready in {row['ready_s']} s ({row['ranks_per_s']} ranks/s), "
        f"{row['requests_per_s']} req/s, worst per-op p99 {row['target_ops_p99_ms']} ms{cpu}, "
        f"errors {row['errors'] or 'none'}"
    )


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [256] if quick else [256, 1024, 4096]
    results: dict[str, Any] = {
        "sizes": sizes,
        "tp": TP,
        "heartbeat_s": HEARTBEAT_S,
        "paced_s": PACED_S,
        "registry_sqlite": {},
        "registry_sqlite_paced": {},
        "registry_sqlite_batched": {},
        "registry_etcd": {},
        "etcd_direct": {},
        "notes": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as name:
        tmp = Path(name)
        for n in sizes:
            say(f"  registry on SQLite, {n} ranks")
            store = f"sqlite:///{tmp}/storm-{n}.db"
            with registry_server(store, log=tmp / f"registry-sqlite-{n}.log") as url:
                results["registry_sqlite"][str(n)] = _guarded(partial(http_storm, url, n))
        # The batched routes: a group's leader registers and renews all its ranks at once.
        from bench.storm_batched import batched_storm

        for n in sizes[-2:] if not quick else sizes:
            say(f"  registry on SQLite, {n} ranks, batched routes")
            store = f"sqlite:///{tmp}/batched-{n}.db"
            with registry_server(store, log=tmp / f"registry-batched-{n}.log") as url:
                results["registry_sqlite_batched"][str(n)] = _guarded(
                    partial(batched_storm, url, n)
                )
        # The same load arriving over PACED_S instead of at once: latency without the queue.
        if not quick:
            say(f"  registry on SQLite, 1024 ranks launching evenly over {PACED_S:g} s")
            with registry_server(f"sqlite:///{tmp}/paced.db", log=tmp / "paced.log") as url:
                results["registry_sqlite_paced"]["1024"] = _guarded(
                    lambda: http_storm(url, 1024, spread_s=PACED_S)
                )
        _etcd_rows(sizes, results, tmp, results["notes"])
    results["ceilings"] = ceilings(quick)
    return results
