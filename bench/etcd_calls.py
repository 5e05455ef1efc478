"""``python -m bench.etcd_calls [--calls 300]`` (not in ``make bench``): what one etcd call costs
the registry's process by how it is paced, on a fresh one-member cluster: a renewal journal's
put (``app/store/etcd/journal.py``: 40 leases, 960 bytes) through ``aetcd``'s gRPC stub,

- ``back_to_back``: each sent when the last was answered;
- ``twenty_at_once``: 20 sent together, the next 20 when all were answered;
- ``alone_every_20ms`` / ``alone_every_32ms``: one, then a pause (the journal's write at 49
  and 31 writes a second, 20 or 40 leases a write); the pause's own cost (the same pauses
  with no call) is subtracted.

Per row: this process's CPU a call (user + system, gRPC's threads included), etcd's, and the
wall time a call. Nothing is asserted."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aetcd
import uvloop
from aetcd import rpc

from bench.common import etcd_cpu_s, say
from harness.etcd import EtcdCluster

VALUE = bytes(960)


async def _paced(client: aetcd.Client, calls: int, pause_s: float) -> None:
    put = rpc.PutRequest(key=b"bench/journal", value=VALUE)
    for _ in range(calls):
        await client.kvstub.Put(put, timeout=5.0)
        if pause_s:
            await asyncio.sleep(pause_s)


async def _at_once(client: aetcd.Client, calls: int, width: int) -> None:
    put = rpc.PutRequest(key=b"bench/journal", value=VALUE)
    for _ in range(calls // width):
        await asyncio.gather(*(client.kvstub.Put(put, timeout=5.0) for _ in range(width)))


async def _pauses(calls: int, pause_s: float) -> float:
    """The CPU of the pauses alone (a timer each), to subtract."""
    begun = time.process_time()
    for _ in range(calls):
        await asyncio.sleep(pause_s)
    return time.process_time() - begun


async def measure(cluster: EtcdCluster, calls: int) -> dict[str, Any]:
    host, port = cluster.endpoints[0].rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    rows: dict[str, Any] = {}
    try:
        await _paced(client, 50, 0.0)  # the channel up, warm
        ways: list[tuple[str, float | None]] = [
            ("back_to_back", 0.0),
            ("twenty_at_once", None),
            ("alone_every_20ms", 0.02),
            ("alone_every_32ms", 0.032),
        ]
        for name, pause in ways:
            cpu0, etcd0, wall0 = time.process_time(), etcd_cpu_s(cluster), time.perf_counter()
            if pause is None:
                await _at_once(client, calls, 20)
            else:
                await _paced(client, calls, pause)
            cpu = time.process_time() - cpu0
            etcd, wall = etcd_cpu_s(cluster) - etcd0, time.perf_counter() - wall0
            if pause:
                cpu -= await _pauses(calls, pause)
                wall -= calls * pause
            rows[name] = {
                "registry_cpu_us_a_call": round(cpu / calls * 1e6),
                "etcd_cpu_us_a_call": round(etcd / calls * 1e6),
                "wall_us_a_call": round(wall / calls * 1e6),
            }
            say(f"{name}: {rows[name]}")
    finally:
        await client.close()
    return {"calls": calls, "value_bytes": len(VALUE), "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="calls a way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, EtcdCluster(Path(root)) as cluster:
        out = uvloop.run(measure(cluster, args.calls))  # the registry's loop
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
