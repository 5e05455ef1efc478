"""The lease clock on etcd (``app.store.etcd.reaper``), on a real etcd: etcd keeps a lease for
the grace past its ttl, the replica that renewed it ends it at its ttl, a lease renewed
through another replica is left alone, and a stall of the replica's loop is credited to the
leases it follows."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.store import Put
from app.store.lease_clock import CLOCK
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available

pytestmark = [pytest.mark.store, pytest.mark.timeout(60)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-reaper")), size=1) as cluster:
        yield cluster


def _stall_the_loop(seconds: float) -> None:
    """Block the event loop, as a stopped or starved registry process is."""
    time.sleep(seconds)


def granted_ttl(cluster: EtcdCluster, lease_id: int) -> int:
    """The TTL etcd granted the lease, as etcdctl reads it."""
    out = cluster.etcdctl("lease", "timetolive", format(lease_id, "x"), "-w", "json")
    return int(out.split('"granted-ttl":')[1].split(",")[0])


def test_etcd_keeps_the_grace_and_the_renewing_replica_ends_the_lease_at_its_ttl(
    etcd: EtcdCluster,
) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            lease = await store.grant_lease(2)
            assert lease.ttl_s == 2  # the registry's figures
            assert lease.remaining_s == 2.0
            assert await asyncio.to_thread(granted_ttl, etcd, lease.id) == 2 + CLOCK.grace_s
            assert (await store.txn([], [Put("agent", b"x", lease.id)])).succeeded
            started = time.monotonic()
            while await store.get("agent") is not None:
                assert time.monotonic() - started < 10, "the lease outlived its ttl by 8 s"
                await asyncio.sleep(0.05)
            gone = time.monotonic() - started
            assert 1.5 < gone < 2 + 1.5, f"ended {gone:.2f} s after its grant (ttl 2 s)"
            # Reads hide it from its logical expiry; the reaper's sweep (each 0.5 s) ends it.
            while store.reaper.ended == 0:
                assert time.monotonic() - started < 2 + 3.0, "hidden, but never ended"
                await asyncio.sleep(0.05)
            assert store.reaper.ended == 1
            assert (await store.entries("agent")).entries == []  # gone from etcd itself
            assert await store.refresh_lease(lease.id) is None
        finally:
            await store.close()

    asyncio.run(body())


def test_a_lease_renewed_through_another_replica_is_left_alone(etcd: EtcdCluster) -> None:
    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        granter, renewer = EtcdStore.from_url(url), EtcdStore.from_url(url)
        try:
            lease = await granter.grant_lease(2)
            assert (await granter.txn([], [Put("agent", b"x", lease.id)])).succeeded
            for _ in range(10):  # 5 s: the granter's own figure ran out 3 s ago
                await asyncio.sleep(0.5)
                assert await renewer.refresh_lease(lease.id) is not None
            assert granter.reaper.ended == 0, "a replica ended a lease another one renews"
            assert await granter.get("agent") is not None
            assert lease.id in granter.reaper.leases  # followed on, with etcd's figure
            # A renewal that reaches the granter now is judged on etcd's figures: renewed.
            assert await granter.refresh_lease(lease.id) is not None
        finally:
            await granter.close()
            await renewer.close()

    asyncio.run(body())


def test_a_stall_of_the_replica_is_credited_to_its_leases(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            lease = await store.grant_lease(2)
            assert (await store.txn([], [Put("agent", b"x", lease.id)])).succeeded
            await asyncio.sleep(1.0)  # the loop's watch runs; the lease has 1 s left
            _stall_the_loop(CLOCK.stall_s + 2.0)  # past the lease's ttl
            # The stall is credited before the lease is judged: shown, renewed, kept.
            assert (await store.range("")).entries, "a lease lapsed by the replica's stall"
            assert await store.refresh_lease(lease.id) is not None
            assert store.reaper.ended == 0
            assert await store.get("agent") is not None
        finally:
            await store.close()

    asyncio.run(body())


def test_a_lease_due_while_etcd_was_unreachable_is_ended_once_it_answers(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    proc = etcd.members[0].proc
    assert proc is not None

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=1.0)
        try:
            lease = await store.grant_lease(2)
            assert (await store.txn([], [Put("agent", b"x", lease.id)])).succeeded
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(4.0)  # due at 2 s: the reaper's calls fail meanwhile
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert store.reaper.ended == 0
            # Reads hide the key once its logical time is out; the reaper must end the lease
            # in etcd too (etcd alone would keep it 58 s).
            started = time.monotonic()
            while store.reaper.ended == 0:
                assert time.monotonic() - started < 10, "a lease due in the outage was dropped"
                await asyncio.sleep(0.1)
            assert store.reaper.ended == 1
            assert (await store.entries("agent")).entries == []  # gone from etcd itself
            assert await store.get("agent") is None
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, logger="app.store"):
        asyncio.run(body())
    said = [r.getMessage() for r in caplog.records if "lease reaper" in r.getMessage()]
    assert len(said) == 2, said  # once when it failed, once when etcd answered again
    assert "REGISTRY_LEASE_GRACE_S" in said[0]
