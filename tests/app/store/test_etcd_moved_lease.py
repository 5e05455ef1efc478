"""A lease whose renewals moved to another replica, on a real etcd with the other replica a
real process (``app.store.etcd.reaper``): the replica that served it before leaves it to the
one renewing it now, so a stall of that one (a heartbeat waiting in it) never lapses the
lease, and a rank that stops renewing is still ended at its ttl by the replica it renewed
through."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from app.store import Put
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available

pytestmark = [pytest.mark.store, pytest.mark.timeout(90)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TTL_S = 2

# The other replica: one etcd store in its own process. It says "ready", reads a lease id,
# renews it every 0.25 s (a line per renewal: "ok" or "gone") ``renewals`` times, says
# "idle" and keeps running (its reaper follows the lease) until killed.
REPLICA = """
import asyncio, sys
from app.store.etcd.store import EtcdStore

async def main() -> None:
    store = EtcdStore.from_url(sys.argv[1], timeout_s=5.0)
    await store.start()
    print("ready", flush=True)
    lease_id = int(await asyncio.to_thread(sys.stdin.readline))
    try:
        for _ in range(int(sys.argv[2])):
            lease = await store.refresh_lease(lease_id)
            print("ok" if lease is not None else "gone", flush=True)
            await asyncio.sleep(0.25)
        print("idle", flush=True)
        await asyncio.sleep(60)
    finally:
        await store.close()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-moved")), size=1) as cluster:
        yield cluster


class Replica:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, within_s: float = 15.0) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), within_s)
        assert raw, "the other replica ended"
        return raw.decode().strip()

    async def renew(self, lease_id: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{lease_id}\n".encode())
        await self.proc.stdin.drain()


@asynccontextmanager
async def other_replica(url: str, renewals: int) -> AsyncIterator[Replica]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        REPLICA,
        url,
        str(renewals),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    replica = Replica(proc)
    try:
        assert await replica.line(30.0) == "ready"
        yield replica
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        await proc.wait()


def test_a_stall_of_the_replica_a_lease_moved_to_never_lapses_it(etcd: EtcdCluster) -> None:
    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        granter = EtcdStore.from_url(url, timeout_s=5.0)
        try:
            async with other_replica(url, 400) as renewer:
                lease = await granter.grant_lease(TTL_S)
                assert (await granter.txn([], [Put("agent", b"x", lease.id)])).succeeded
                granted = time.monotonic()
                await renewer.renew(lease.id)
                # The renewals moved: the granter's own figure runs out at 2 s, and its
                # reaper (every 0.5 s) finds the lease renewed through the other replica.
                while time.monotonic() - granted < TTL_S + 1.5:
                    assert await renewer.line() == "ok"
                # The renewer stops (a stalled loop) past the lease's ttl, a heartbeat
                # waiting in it; once it runs again it renews, its stall credited.
                os.kill(renewer.proc.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(TTL_S + 2.0)
                finally:
                    os.kill(renewer.proc.pid, signal.SIGCONT)
                answer = await renewer.line()
                assert answer == "ok", "the lease lapsed while the replica renewing it stalled"
                assert granter.reaper.ended == 0, "a replica ended a lease another one renews"
                assert await granter.get("agent") is not None
        finally:
            await granter.close()

    asyncio.run(body())


def test_a_moved_lease_not_renewed_is_ended_at_its_ttl_by_its_replica(
    etcd: EtcdCluster,
) -> None:
    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        granter = EtcdStore.from_url(url, timeout_s=5.0)
        try:
            async with other_replica(url, 8) as renewer:
                lease = await granter.grant_lease(TTL_S)
                assert (await granter.txn([], [Put("agent", b"x", lease.id)])).succeeded
                await renewer.renew(lease.id)
                last = time.monotonic()
                while (answer := await renewer.line()) == "ok":
                    last = time.monotonic()  # the rank's last renewal, answered
                assert answer == "idle"
                # The rank stops renewing; the replica it renewed through runs on and ends
                # its lease at its ttl (reaped each 0.5 s; 1.5 s more for a loaded machine).
                while await granter.get("agent") is not None:
                    elapsed = time.monotonic() - last
                    assert elapsed < TTL_S + 0.5 + 1.5, f"still there {elapsed:.2f} s after"
                    await asyncio.sleep(0.05)
                assert time.monotonic() - last > TTL_S - 0.5, "ended before its ttl"
                assert granter.reaper.ended == 0  # not by the replica it moved away from
        finally:
            await granter.close()

    asyncio.run(body())
