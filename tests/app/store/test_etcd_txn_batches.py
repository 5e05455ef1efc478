"""Transactions sent together on a real etcd (``app/store/etcd/txns.py``): the transactions a
replica has ready at once reach etcd as a few shared Txns, not one Txn each; each keeps its own
outcome (a lost compare, a lease gone) as if it had been sent alone; two that touch the same
group never share one (etcd would judge both against the state before either); a frozen etcd
fails them within twice the store's deadline."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest

from app.store import Compare, Delete, Put, Unavailable
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from tests.support.faults import while_stopped

pytestmark = [pytest.mark.store, pytest.mark.timeout(90)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.store import EtcdStore  # noqa: E402

BLOB = os.urandom(3928)  # the size bench/fleet.py registers a rank with


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1) as cluster:
        yield cluster


def txns(etcd: EtcdCluster) -> float:
    return etcd.metric("grpc_server_started_total", "Txn")


def registration(gid: str, lease: int) -> tuple[list[Compare], list[Put]]:
    """A node's eight ranks as ``register_agents`` writes them: a record and a blob each."""
    puts = [
        put
        for rank in range(8)
        for put in (
            Put(f"groups/{gid}/agents/{rank:05d}", b'{"rank": %d}' % rank, lease=lease),
            Put(f"blobs/{gid}/{rank:05d}", BLOB, lease=lease),
        )
    ]
    return [Compare(f"groups/{gid}/agents/{rank:05d}", 0) for rank in range(8)], puts


def test_registrations_at_once_reach_etcd_in_a_few_shared_txns(etcd: EtcdCluster) -> None:
    """48 registrations (16 puts, 32 KiB each) in one turn of the loop: every one won and
    readable, at most a Txn for each 4 of them (one Txn each before)."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            leases = [await store.grant_lease(30) for _ in range(48)]
            before = txns(etcd)
            results = await asyncio.gather(
                *(store.txn(*registration(f"g{i:03d}", lease.id)) for i, lease in enumerate(leases))
            )
            sent = txns(etcd) - before
            assert all(r.succeeded for r in results)
            assert sent <= 48 / 4, f"48 registrations took {sent:g} Txns"
            for i in range(48):
                entry = await store.get(f"blobs/g{i:03d}/00007")
                assert entry is not None
                assert entry.value == BLOB
                assert entry.mod_revision == results[i].revision
            # Won again by none: each compare now fails, each on its own.
            again = await asyncio.gather(
                *(store.txn(*registration(f"g{i:03d}", leases[i].id)) for i in range(8))
            )
            assert not any(r.succeeded for r in again)
        finally:
            await store.close()

    asyncio.run(body())


def test_a_lease_gone_loses_its_own_transaction_only(etcd: EtcdCluster) -> None:
    """Eight registrations at once, one naming a revoked lease: etcd refuses the shared Txn,
    each is sent again alone, that one lost (as a lone one is), the seven others won."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            leases = [await store.grant_lease(30) for _ in range(8)]
            await store.revoke_lease(leases[5].id)
            results = await asyncio.gather(
                *(store.txn(*registration(f"g{i}", lease.id)) for i, lease in enumerate(leases))
            )
            assert [r.succeeded for r in results] == [i != 5 for i in range(8)]
            assert await store.get("blobs/g5/00000") is None
            assert await store.get("blobs/g4/00000") is not None
        finally:
            await store.close()

    asyncio.run(body())


def test_transactions_on_one_group_never_share_a_txn(etcd: EtcdCluster) -> None:
    """Two transactions on one group, each writing what the other's compare says is absent
    (a relaunch deleting the agents, a registration comparing them): sent apart, exactly one
    wins, 20 times out of 20. In one shared Txn both would (etcd judges nested compares
    against the state before the Txn). So too for a pair whose keys span two groups; a write
    and a prefix delete on one group both apply."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        try:
            for i in range(20):
                gid = f"skew{i}"
                engine = f"groups/{gid}/engine"
                agent = f"groups/{gid}/agents/00000"
                one = store.txn([Compare(agent, 0)], [Put(engine, b"relaunched")])
                other = store.txn([Compare(engine, 0)], [Put(agent, b"registered")])
                won = [r.succeeded for r in await asyncio.gather(one, other)]
                assert sorted(won) == [False, True], f"round {i}: {won}"
            apart = await asyncio.gather(
                store.txn([Compare("groups/a/agents/00000", 0)], [Put("groups/b/engine", b"x")]),
                store.txn([Compare("groups/b/engine", 0)], [Put("groups/a/agents/00000", b"y")]),
            )
            # Across two groups: each touches both, so again apart, and one wins.
            assert sorted(r.succeeded for r in apart) == [False, True]
            wide = await asyncio.gather(
                store.txn([], [Put("groups/c/engine", b"x")]),
                store.txn([], [Delete("groups/c/", prefix=True)]),
            )
            assert all(r.succeeded for r in wide)
        finally:
            await store.close()

    asyncio.run(body())


def test_a_frozen_etcd_fails_waiting_transactions_within_twice_the_deadline(
    etcd: EtcdCluster,
) -> None:
    """etcd stops (SIGSTOP) with six transactions on one group ready (each must wait for the
    one before: a queue behind one Txn in flight): every one ends Unavailable within twice
    the store's 1 s deadline; resumed, the next one wins."""
    proc = etcd.members[0].proc
    assert proc is not None

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=1.0)
        try:
            await store.txn([], [Put("groups/q/engine", b"0")])
            stuck, took = await while_stopped(
                proc.pid, [store.txn([], [Put("groups/q/engine", b"%d" % i)]) for i in range(6)]
            )
            assert all(isinstance(s, Unavailable) for s in stuck), stuck
            assert took < 2.5, f"transactions to a frozen etcd took {took:.2f} s (deadline 1 s)"
            assert any("waited" in str(s) for s in stuck), [str(s) for s in stuck]
            result = await store.txn([], [Put("groups/q/engine", b"after")])
            assert result.succeeded
        finally:
            await store.close()

    asyncio.run(body())
