"""Lease renewals on etcd go through a member's pool of long-lived keep-alive streams
(``app.store.etcd.keepalive``): a stream a renewal at a time, reused, each answer with the
revision it was read at; within the store's deadline when etcd stops answering, and right
again after it resumes. Real etcd; the streams it served counted from its own metrics."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.store import Put
from app.store import Unavailable as StoreUnavailable
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from tests.support.faults import while_stopped

pytestmark = pytest.mark.store

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.keepalive import MOST_STREAMS  # noqa: E402
from app.store.etcd.store import EtcdStore  # noqa: E402


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-keepalive")), size=1) as cluster:
        yield cluster


def streams_started(cluster: EtcdCluster) -> float:
    return cluster.metric("grpc_server_started_total", "LeaseKeepAlive")


@pytest.mark.timeout(60)
def test_renewals_reuse_streams_and_say_their_revision(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            leases = [await store.grant_lease(60) for _ in range(200)]
            gone = leases[7]
            await store.revoke_lease(gone.id)
            written = (await store.txn([], [Put("k", b"v")])).revision
            before = await asyncio.to_thread(streams_started, etcd)
            one_by_one = [await store.refresh_lease(lease.id) for lease in leases]
            sequential = await asyncio.to_thread(streams_started, etcd) - before
            assert sequential == 1, f"200 renewals in turn opened {sequential:g} streams"
            answers = await asyncio.gather(*(store.refresh_lease(lease.id) for lease in leases * 5))
            opened = await asyncio.to_thread(streams_started, etcd) - before
            answers += one_by_one
            for lease, answer in zip(leases * 6, answers, strict=True):
                if lease is gone:
                    assert answer is None
                    continue
                assert answer is not None
                assert answer.id == lease.id
                assert answer.ttl_s == 60
                assert answer.revision is not None
                assert answer.revision >= written
            assert opened <= MOST_STREAMS + 1, f"1,000 renewals opened {opened:g} streams"
        finally:
            await store.close()

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_renewals_to_a_frozen_etcd_end_in_time_and_answers_stay_aligned(
    etcd: EtcdCluster,
) -> None:
    """etcd stops (SIGSTOP) with renewals written and waiting for a stream: each ends
    StoreUnavailable within the store's 1 s deadline. Resumed, every renewal gets its own
    lease's answer (a revoked lease: None), however many streams were left mid-answer."""
    proc = etcd.members[0].proc
    assert proc is not None

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=1.0)
        try:
            leases = [await store.grant_lease(60) for _ in range(20)]
            await store.revoke_lease(leases[3].id)
            stuck, took = await while_stopped(
                proc.pid, [store.refresh_lease(lease.id) for lease in leases * 3]
            )
            assert all(isinstance(a, StoreUnavailable) for a in stuck), stuck[:3]
            assert took < 2.0, f"renewals to a frozen etcd took {took:.2f} s (deadline 1 s)"
            for _ in range(3):
                answers = await asyncio.gather(*(store.refresh_lease(x.id) for x in leases))
                for lease, answer in zip(leases, answers, strict=True):
                    if lease is leases[3]:
                        assert answer is None
                    else:
                        assert answer is not None
                        assert answer.id == lease.id
        finally:
            await store.close()

    asyncio.run(body())
