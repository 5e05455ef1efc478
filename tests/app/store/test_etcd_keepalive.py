"""Lease renewals on etcd go through a few long-lived keep-alive streams
(``app.store.etcd_keepalive``): answered in order, each with the revision it was applied at,
within the store's deadline when etcd stops answering, and aligned again after it resumes.
Real etcd; the streams it served counted from its own metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.store import Put
from app.store import Unavailable as StoreUnavailable
from tests.support.etcd import SKIP_REASON, EtcdCluster, etcd_available

pytestmark = pytest.mark.store

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd import EtcdStore  # noqa: E402
from app.store.etcd_keepalive import STREAMS  # noqa: E402


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-keepalive")), size=1) as cluster:
        yield cluster


def streams_started(cluster: EtcdCluster) -> float:
    text = httpx.get(f"{cluster.members[0].client_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_started_total") and 'grpc_method="LeaseKeepAlive"' in line
    )


@pytest.mark.timeout(60)
def test_renewals_share_a_few_streams_and_say_their_revision(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            leases = [await store.grant_lease(60) for _ in range(200)]
            gone = leases[7]
            await store.revoke_lease(gone.id)
            before = await asyncio.to_thread(streams_started, etcd)
            written = (await store.txn([], [Put("k", b"v")])).revision
            answers = await asyncio.gather(*(store.refresh_lease(lease.id) for lease in leases * 5))
            opened = await asyncio.to_thread(streams_started, etcd) - before
            for lease, answer in zip(leases * 5, answers, strict=True):
                if lease is gone:
                    assert answer is None
                    continue
                assert answer is not None
                assert answer.id == lease.id
                assert answer.ttl_s == 60
                assert answer.revision is not None
                assert answer.revision >= written
            assert opened <= STREAMS, f"1,000 renewals opened {opened:g} streams"
        finally:
            await store.close()

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_renewals_to_a_frozen_etcd_end_in_time_and_answers_stay_aligned(
    etcd: EtcdCluster,
) -> None:
    """etcd stops (SIGSTOP) with renewals written and queued: each ends StoreUnavailable
    within the store's 1 s deadline. Resumed, etcd answers the abandoned ones first; the
    next renewals get their own lease's answer (a revoked lease: None)."""
    proc = etcd.members[0].proc
    assert proc is not None

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=1.0)
        try:
            leases = [await store.grant_lease(60) for _ in range(20)]
            await store.revoke_lease(leases[3].id)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                stuck = await asyncio.gather(
                    *(store.refresh_lease(lease.id) for lease in leases * 3),
                    return_exceptions=True,
                )
                took = time.monotonic() - t0
            finally:
                os.kill(proc.pid, signal.SIGCONT)
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
