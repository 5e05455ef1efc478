"""``python -m bench.etcd_renewals [--members 1] [--renewals 3000]`` (not in ``make bench``): what
one etcd lease renewal costs the registry's process, and etcd, three ways in one run on a
fresh cluster, each at 1, 16 and 64 renewals in flight:

- ``stream_each``: a ``LeaseKeepAlive`` stream opened for each renewal (write, half-close,
  read, cancel), what the etcd store did before ``app/store/etcd/keepalive.py`` (the
  baseline);
- ``pool``: ``EtcdStore.refresh_lease`` as it is (a stream a renewal at a time from the
  member's pool of idle streams, through the store's failover and deadline);
- ``one_stream``: a tick's renewals coalesced on one long-lived ``LeaseKeepAlive`` stream
  (every request of the batch written, then every answer read), the floor of "renewals
  coalesced per replica" (``docs/operations.md``: etcd still answers one request a lease);
- ``gateway``: etcd's JSON gateway (``POST /v3/lease/keepalive``) on kept-alive HTTP/1.1
  connections, a minimal asyncio client: for reference (the store does not use it).

Per row: this process's CPU a renewal (user + system, the gRPC poller thread included),
etcd's CPU a renewal (every member, from ``/proc``), renewals a second, and the ratio of this
process's CPU to the baseline's at the same concurrency. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aetcd import rpc

from app.store.etcd.store import EtcdStore
from bench.common import etcd_cpu_s, say
from harness.etcd import EtcdCluster

LEASES = 500


async def _stream_each(store: EtcdStore, lease_id: int) -> None:
    """The baseline: a stream for one renewal, as the store did before its pool."""
    client = store._cluster.members[0].client
    assert client is not None
    call = client.leasestub.LeaseKeepAlive(timeout=10.0)
    try:
        await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
        await call.done_writing()
        reply = await call.read()
        assert int(reply.TTL) > 0
    finally:
        call.cancel()


class _OneStream:
    """One long-lived keep-alive stream; ``renew_all`` renews a batch on it, pipelined."""

    def __init__(self, store: EtcdStore) -> None:
        client = store._cluster.members[0].client
        assert client is not None
        self.call = client.leasestub.LeaseKeepAlive()

    async def renew_all(self, leases: list[int]) -> None:
        for lease_id in leases:
            await self.call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
        for lease_id in leases:
            reply = await self.call.read()
            assert int(reply.ID) == lease_id
            assert int(reply.TTL) > 0

    def close(self) -> None:
        self.call.cancel()


async def _measure_batched(
    cluster: EtcdCluster, one: _OneStream, leases: list[int], batch: int, n: int
) -> dict[str, float]:
    """As ``_measure``, with ``batch`` renewals a batch on one stream (batches in turn)."""
    picks = [leases[i % len(leases)] for i in range(n)]
    await one.renew_all(picks[:batch])  # warm
    etcd0, cpu0, t0 = etcd_cpu_s(cluster), time.process_time(), time.perf_counter()
    for at in range(0, n, batch):
        await one.renew_all(picks[at : at + batch])
    elapsed = time.perf_counter() - t0
    return {
        "in_flight": batch,
        "cpu_us": round(1e6 * (time.process_time() - cpu0) / n),
        "etcd_cpu_us": round(1e6 * (etcd_cpu_s(cluster) - etcd0) / n),
        "per_s": round(n / elapsed),
    }


class _Gateway:
    """Kept-alive HTTP/1.1 connections to etcd's JSON gateway, one renewal each at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def renew(self, lease_id: int) -> None:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps({"ID": lease_id}).encode()
        writer.write(
            b"POST /v3/lease/keepalive HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        answer = b""
        while True:  # the gateway streams its answer chunked
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            answer += (await reader.readexactly(size + 2))[:-2]
        assert int(json.loads(answer)["result"]["TTL"]) > 0, answer
        self.idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def _measure(
    cluster: EtcdCluster,
    renew: Callable[[int], Awaitable[None]],
    leases: list[int],
    in_flight: int,
    n: int,
) -> dict[str, float]:
    slots = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with slots:
            await renew(leases[i % len(leases)])

    await asyncio.gather(*(one(i) for i in range(min(n, 200))))  # warm: streams, connections
    etcd0, cpu0, t0 = etcd_cpu_s(cluster), time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    return {
        "in_flight": in_flight,
        "cpu_us": round(1e6 * (time.process_time() - cpu0) / n),
        "etcd_cpu_us": round(1e6 * (etcd_cpu_s(cluster) - etcd0) / n),
        "per_s": round(n / elapsed),
    }


async def _run(cluster: EtcdCluster, n: int) -> dict[str, Any]:
    store = EtcdStore.from_url(cluster.url("renewals"), timeout_s=10.0)
    await store.start()
    host, port = cluster.endpoints[0].split(":")
    gateway = _Gateway(host, int(port))
    one = _OneStream(store)
    try:
        leases = [(await store.grant_lease(300)).id for _ in range(LEASES)]

        async def pool(lease_id: int) -> None:
            assert await store.refresh_lease(lease_id) is not None

        ways: dict[str, Callable[[int], Awaitable[None]]] = {
            "stream_each": lambda lease_id: _stream_each(store, lease_id),
            "pool": pool,
            "gateway": gateway.renew,
        }
        rows: dict[str, list[dict[str, float]]] = {way: [] for way in [*ways, "one_stream"]}
        for in_flight in (1, 16, 64):
            for way, renew in ways.items():  # interleaved: the machine's drift hits all alike
                say(f"etcd renewals: {way}, {in_flight} in flight")
                rows[way].append(await _measure(cluster, renew, leases, in_flight, n))
            say(f"etcd renewals: one_stream, batches of {in_flight}")
            rows["one_stream"].append(await _measure_batched(cluster, one, leases, in_flight, n))
        for way in ("pool", "one_stream", "gateway"):
            for row, base in zip(rows[way], rows["stream_each"], strict=True):
                row["cpu_vs_stream_each"] = round(row["cpu_us"] / base["cpu_us"], 2)
        return {"members": len(cluster.members), "renewals": n, "rows": rows}
    finally:
        one.close()
        gateway.close()
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1)
    parser.add_argument("--renewals", type=int, default=3000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="bench-renewals-") as root,
        EtcdCluster(Path(root), size=args.members) as cluster,
    ):
        print(json.dumps(asyncio.run(_run(cluster, args.renewals)), indent=1))


if __name__ == "__main__":
    main()
