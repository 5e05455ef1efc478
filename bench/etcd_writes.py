"""``python -m bench.etcd_writes [--members 3] [--nodes 2000] [--regions 80] [--per-txn 11]``
(not in ``make bench``): etcd's own CPU for each kind of request the registry sends it, the
figures ``docs/operations.md``'s sizing table is argued from.

A fresh cluster of ``--members`` with the fleet's settings (``bench.fleet``), fed what the
registry sends for ``--nodes`` TP 8 nodes, one kind at a time, etcd's CPU (every member, from
``/proc``) read before and after each:

- ``lease_grant``: a node's registration takes one lease (64 in flight);
- ``registration``: a node's 8 agent records and 8 blobs (``bench/fleet_load.py``'s bodies,
  ``--regions`` a rank; the records as ``app/registry/batches.py`` writes them), each key on the
  node's lease and each agent key compared absent, as one nested transaction, ``--per-txn``
  of them a Txn, one Txn in flight (``app/store/etcd/txns.py``; a 100,000-rank launch sent
  12,500 registrations in about 1,100 Txns);
- ``journal_put``: the renewal journal's write of 25 leases (``journal.pack``), one in flight;
- ``keepalive``: a lease renewal on one ``LeaseKeepAlive`` stream, one at a time (W 0's
  heartbeat).

Per kind: etcd's CPU a request, requests a second, and for registrations the bytes a node and
etcd's CPU a MiB. The blobs are random bytes (incompressible), as the fleet's. Prints one JSON
object; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd
from aetcd import rpc

from app.registry import keys
from app.registry.records import AgentRecord, trusted
from app.store.etcd.journal import PREFIX, pack
from bench.common import etcd_cpu_s, machine, say
from bench.fleet import REGIONS, _etcd, blob_bytes
from bench.fleet_load import TP, Fleet

ROOT = "/registry/"  # the registry's key prefix, as a fleet's store URL names it
IN_FLIGHT = 64
JOURNAL_LEASES = 25  # leases a journal write carries at a fleet's pace (20-50 ms ticks)


async def _timed(
    cluster: Any, n: int, run: Callable[[], Awaitable[None]], what: str
) -> dict[str, float]:
    say(f"etcd_writes: {what}")
    cpu0, t0 = etcd_cpu_s(cluster), time.perf_counter()
    await run()
    elapsed, cpu = time.perf_counter() - t0, etcd_cpu_s(cluster) - cpu0
    return {"n": n, "etcd_cpu_ms": round(1e3 * cpu / n, 3), "per_s": round(n / elapsed, 1)}


def _node_txn(fleet: Fleet, index: int, lease: int) -> tuple[rpc.TxnRequest, int]:
    """A node's registration as one transaction: its agent records and blobs on its lease,
    each agent key compared absent; and its bytes."""
    gid = fleet.groups[index]
    eid = f"engine-{index}"
    compares, puts, size = [], [], 0
    for agent in fleet.agents(index, eid):
        record = trusted(
            AgentRecord,
            {
                **{k: agent[k] for k in ("rank", "engine_id", "agent_name", "host", "ttl_s")},
                "generation": 1,
                "registered_at": "2026-12-06T10:00:00.000000Z",
                "lease": lease,
                "registered_by": None,
                "kv": agent["kv"],
            },
        )
        agent_key = (ROOT + keys.agent(gid, agent["rank"])).encode()
        blob_key = (ROOT + keys.blob(gid, agent["rank"])).encode()
        value, blob = keys.dump(record), base64.b64decode(agent["agent_metadata"])
        compares.append(
            rpc.Compare(
                key=agent_key,
                result=rpc.Compare.CompareResult.EQUAL,
                target=rpc.Compare.CompareTarget.VERSION,
                version=0,
            )
        )
        puts.append(
            rpc.RequestOp(request_put=rpc.PutRequest(key=agent_key, value=value, lease=lease))
        )
        puts.append(
            rpc.RequestOp(request_put=rpc.PutRequest(key=blob_key, value=blob, lease=lease))
        )
        size += len(agent_key) + len(value) + len(blob_key) + len(blob)
    return rpc.TxnRequest(compare=compares, success=puts), size


async def measure(members: int, nodes: int, regions: int, per_txn: int) -> dict[str, Any]:
    fleet = Fleet(nodes * TP, blob_bytes(regions), regions)
    with tempfile.TemporaryDirectory() as tmp, _etcd(Path(tmp), members) as cluster:
        host, port = cluster.members[0].client_url.split("//")[1].rsplit(":", 1)
        client = aetcd.Client(host=host, port=int(port))
        await client.connect()
        try:
            return await _kinds(cluster, client, fleet, nodes, per_txn)
        finally:
            await client.close()


async def _kinds(
    cluster: Any, client: aetcd.Client, fleet: Fleet, nodes: int, per_txn: int
) -> dict[str, Any]:
    leases: list[int] = []
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def grant() -> None:
        async with gate:
            reply = await client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=600), timeout=30)
            leases.append(int(reply.ID))

    async def grants() -> None:
        await asyncio.gather(*(grant() for _ in range(nodes)))

    out: dict[str, Any] = {}
    out["lease_grant"] = await _timed(cluster, nodes, grants, f"{nodes} lease grants")

    built = [_node_txn(fleet, i, leases[i]) for i in range(nodes)]
    node_bytes = sum(size for _, size in built) / nodes

    async def registrations() -> None:
        for at in range(0, nodes, per_txn):
            nested = [rpc.RequestOp(request_txn=txn) for txn, _ in built[at : at + per_txn]]
            reply = await client.kvstub.Txn(rpc.TxnRequest(success=nested), timeout=60)
            if not all(r.response_txn.succeeded for r in reply.responses):
                raise RuntimeError("a registration's compares failed: nothing was written")

    row = await _timed(cluster, nodes, registrations, f"{nodes} registrations, {per_txn} a Txn")
    row["bytes_a_node"] = round(node_bytes)
    row["etcd_cpu_ms_a_mib"] = round(row["etcd_cpu_ms"] / (node_bytes / 2**20), 1)
    out["registration"] = row

    presence = await client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=60), timeout=30)
    value = pack((lease, 30, 30.0, 180.0) for lease in leases[:JOURNAL_LEASES])
    journal_key = (ROOT + PREFIX + "bench").encode()
    writes = max(200, nodes // 4)

    async def journal() -> None:
        for _ in range(writes):
            put = rpc.PutRequest(key=journal_key, value=value, lease=int(presence.ID))
            await client.kvstub.Put(put, timeout=30)

    out["journal_put"] = await _timed(cluster, writes, journal, f"{writes} journal writes")

    stream = client.leasestub.LeaseKeepAlive()

    async def keepalives() -> None:
        for lease in leases:
            await stream.write(rpc.LeaseKeepAliveRequest(ID=lease))
            assert int((await stream.read()).TTL) > 0

    try:
        out["keepalive"] = await _timed(cluster, nodes, keepalives, f"{nodes} renewals")
    finally:
        stream.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--regions", type=int, default=REGIONS, help="NIXL regions a rank")
    parser.add_argument("--per-txn", type=int, default=11, help="registrations a shared Txn")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.members < 1 or args.regions < 1 or args.per_txn < 1:
        parser.error("--members, --nodes, --regions and --per-txn are at least 1")
    kinds = asyncio.run(measure(args.members, args.nodes, args.regions, args.per_txn))
    result = {
        "machine": machine(),
        "members": args.members,
        "nodes": args.nodes,
        "regions": args.regions,
        "blob_bytes": blob_bytes(args.regions),
        "per_txn": args.per_txn,
        **kinds,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
