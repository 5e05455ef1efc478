"""The etcd store under a launch storm's load, against a real etcd of its own (so that its
counters, read from etcd's /metrics, count this module's traffic only).

At 4,096 ranks the registry on etcd collapsed: every held ``wait_ready`` opened its own watch
(aetcd creates them one at a time on one stream) and probed etcd every second, and every read
of a group asked each agent's lease for its remaining time, so the store's RPCs outgrew what
one process could send; calls queued past the store timeout (503) and the storm ran for
minutes. These tests hold the store to what a storm needs: waiters cost one watch and no
polling, concurrent reads ask each foreign lease once, and a frozen etcd answers
StoreUnavailable within the bound however many calls are waiting.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.store import Put
from app.store import Unavailable as StoreUnavailable
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available

pytestmark = [pytest.mark.store, pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)]
pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")

from app.store.etcd.store import EtcdStore  # noqa: E402


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-load")), size=1) as cluster:
        yield cluster


def endpoint(cluster: EtcdCluster) -> tuple[str, int]:
    host, port = cluster.endpoints[0].split(":")
    return host, int(port)


def started(cluster: EtcdCluster, method: str) -> float:
    return cluster.metric("grpc_server_started_total", method)


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_thousand_waiters_cost_one_watch_no_polling_and_all_wake(etcd: EtcdCluster) -> None:
    """125 groups x 8 decode ranks held in wait_ready, then every group completes."""

    async def body() -> None:
        store = EtcdStore([endpoint(etcd)], uuid.uuid4().hex, timeout_s=2.0)
        try:
            head = await store.txn([], [Put("groups/seed", b"x")])
            waiters = [
                asyncio.create_task(store.wait(f"groups/g{g}/", head.revision, 30.0))
                for g in range(125)
                for _ in range(8)
            ]
            await asyncio.sleep(1.0)  # all of them held now
            ranges = await asyncio.to_thread(started, etcd, "Range")
            await asyncio.sleep(2.0)
            idle_ranges = await asyncio.to_thread(started, etcd, "Range") - ranges
            watchers = await asyncio.to_thread(etcd.metric, "etcd_debugging_mvcc_watcher_total")
            assert not any(w.done() for w in waiters), "a waiter returned before any change"
            t0 = time.monotonic()
            await asyncio.gather(
                *(store.txn([], [Put(f"groups/g{g}/a", b"1")]) for g in range(125))
            )
            woke = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 20)
            elapsed = time.monotonic() - t0
        finally:
            await store.close()
        failed = [w for w in woke if w is not True]
        assert not failed, f"{len(failed)} of 1000 waiters did not wake: {failed[:3]}"
        assert watchers <= 2, f"{watchers:g} etcd watchers for 1000 waiters (one is enough)"
        # One liveness probe per second for the whole store, not one per waiter.
        assert idle_ranges <= 6, f"{idle_ranges:g} reads in 2 s by 1000 idle waiters"
        assert elapsed < 10, f"the waiters took {elapsed:.1f} s to wake"

    run(body)


@pytest.mark.timeout(60)
def test_concurrent_reads_of_a_group_ask_each_foreign_lease_once(etcd: EtcdCluster) -> None:
    """Leases this store granted are known; another replica's are asked once, not per read."""

    async def body() -> None:
        prefix = uuid.uuid4().hex
        mine = EtcdStore([endpoint(etcd)], prefix, timeout_s=5.0)
        other = EtcdStore([endpoint(etcd)], prefix, timeout_s=5.0)
        try:
            ops = []
            for rank, store in enumerate([mine] * 4 + [other] * 4):
                lease = await store.grant_lease(30)
                ops.append(Put(f"groups/g/agents/{rank}", b"a", lease=lease.id))
            await mine.txn([], ops)
            before = await asyncio.to_thread(started, etcd, "LeaseTimeToLive")
            snaps = await asyncio.gather(*(mine.range("groups/g/") for _ in range(400)))
            asked = await asyncio.to_thread(started, etcd, "LeaseTimeToLive") - before
        finally:
            await mine.close()
            await other.close()
        assert all(len(s.lease_remaining_s) == 8 for s in snaps)
        assert all(25 < left <= 30 for s in snaps for left in s.lease_remaining_s.values())
        assert asked <= 4, f"400 reads asked etcd {asked:g} times for 4 foreign leases"

    run(body)


@pytest.mark.timeout(60)
def test_a_frozen_etcd_answers_store_unavailable_within_the_bound_under_load(
    etcd: EtcdCluster,
) -> None:
    """300 calls at once against an etcd that stops answering (SIGSTOP), 16 in flight at
    most: every one answers StoreUnavailable within the store timeout, none hangs."""
    proc = etcd.members[0].proc
    assert proc is not None

    async def body() -> None:
        store = EtcdStore([endpoint(etcd)], uuid.uuid4().hex, timeout_s=1.0, max_in_flight=16)

        async def timed(call: Coroutine[Any, Any, object]) -> tuple[BaseException | None, float]:
            t0 = time.monotonic()
            try:
                await call
            except StoreUnavailable as exc:
                return exc, time.monotonic() - t0
            return None, time.monotonic() - t0

        try:
            await store.ping()
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                calls = [
                    c
                    for i in range(100)
                    for c in (
                        store.get(f"k{i}"),
                        store.txn([], [Put(f"k{i}", b"v")]),
                        store.grant_lease(10),
                    )
                ]
                results = await asyncio.gather(*(timed(c) for c in calls))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await store.ping()  # and it serves again once etcd does
        finally:
            await store.close()
        unanswered = [r for r in results if r[0] is None]
        assert not unanswered, "a call to a frozen etcd succeeded"
        worst = max(elapsed for _, elapsed in results)
        assert worst < 2.0, f"a call took {worst:.2f} s against a 1 s store timeout"
        details = {str(exc) for exc, _ in results}
        assert all(re.search(r"etcd did not (answer|take)", d) for d in details), details

    run(body)


@pytest.mark.timeout(60)
def test_a_burst_of_identical_reads_is_one_read_and_sees_every_earlier_write(
    etcd: EtcdCluster,
) -> None:
    """The 7 ranks of a group fetching its engine at once, 50 groups over: reads of one
    prefix issued before the first is sent share it, and each sees what was written first."""

    async def body() -> None:
        store = EtcdStore([endpoint(etcd)], uuid.uuid4().hex, timeout_s=5.0)
        try:
            await store.txn([], [Put(f"groups/g{g}/engine", b"e") for g in range(50)])
            before = await asyncio.to_thread(started, etcd, "Range")
            snaps = await asyncio.gather(
                *(store.range(f"groups/g{g}/") for g in range(50) for _ in range(7))
            )
            reads = await asyncio.to_thread(started, etcd, "Range") - before
            for g in range(3):  # a read after a write sees it, however reads are shared
                rival = asyncio.create_task(store.range(f"groups/g{g}/"))
                await store.txn([], [Put(f"groups/g{g}/agents/0", b"a")])
                snap = await store.range(f"groups/g{g}/")
                assert [e.key for e in snap.entries][-1] == f"groups/g{g}/engine"
                assert any(e.key.endswith("agents/0") for e in snap.entries), snap
                await rival
        finally:
            await store.close()
        assert all(len(s.entries) == 1 for s in snaps)
        assert reads <= 60, f"350 reads of 50 prefixes sent {reads:g} reads to etcd"

    run(body)


@pytest.mark.timeout(60)
def test_renewals_in_flight_when_etcd_dies_fail_over_or_answer_503_never_500(
    etcd: EtcdCluster,
) -> None:
    """Heartbeats share one keep-alive stream: when it ends under them (etcd killed and
    restarted), each renewal is answered (a Lease), or StoreUnavailable, nothing else."""

    async def body() -> None:
        store = EtcdStore([endpoint(etcd)], uuid.uuid4().hex, timeout_s=3.0)
        try:
            leases = [await store.grant_lease(60) for _ in range(50)]
            await asyncio.gather(*(store.refresh_lease(lease.id) for lease in leases))

            async def kill_and_restart() -> None:
                await asyncio.sleep(0.05)
                await asyncio.to_thread(etcd.kill, 0)
                await asyncio.to_thread(etcd.restart, 0)

            chaos = asyncio.create_task(kill_and_restart())
            answers = await asyncio.gather(
                *(store.refresh_lease(lease.id) for lease in leases * 8), return_exceptions=True
            )
            await chaos
            await asyncio.to_thread(etcd.wait_healthy, 30.0)
            odd = [a for a in answers if a is not None and type(a).__name__ not in ("Lease",)]
            assert all(isinstance(a, StoreUnavailable) for a in odd), odd[:3]
            after = await asyncio.gather(*(store.refresh_lease(lease.id) for lease in leases))
            assert all(a is not None and a.remaining_s > 30 for a in after), after[:3]
        finally:
            await store.close()

    run(body)
