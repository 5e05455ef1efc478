"""What the etcd store adds to the contract: failover across endpoints, a bounded
StoreUnavailable when no member answers, big blobs, and prefixes that keep deployments
apart. Runs against the session's real etcd."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from app.store import Put, Store
from app.store import Unavailable as StoreUnavailable
from harness.etcd import SKIP_REASON, etcd_available
from harness.server import free_port
from tests.app.store.conftest import shared_etcd

pytestmark = [pytest.mark.store, pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)]
aetcd = pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")

from app.store.etcd.store import EtcdStore  # noqa: E402


def live_endpoint() -> tuple[str, int]:
    host, port = shared_etcd().endpoints[0].split(":")
    return host, int(port)


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def test_dead_first_endpoint_fails_over_to_a_live_one() -> None:
    async def body() -> None:
        store = EtcdStore([("127.0.0.1", free_port()), live_endpoint()], uuid.uuid4().hex)
        try:
            t0 = time.monotonic()
            assert (await store.txn([], [Put("a", b"1")])).succeeded
            entry = await store.get("a")
            assert entry is not None
            assert entry.value == b"1"
            assert time.monotonic() - t0 < 3
        finally:
            await store.close()

    run(body)


def test_no_member_answering_raises_store_unavailable_within_the_timeout() -> None:
    async def body() -> None:
        dead = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
        store = EtcdStore(dead, "nobody", timeout_s=1.0)
        calls: list[Callable[[Store], Awaitable[object]]] = [
            lambda s: s.get("a"),
            lambda s: s.range("a/"),
            lambda s: s.txn([], [Put("a", b"1")]),
            lambda s: s.grant_lease(10),
            lambda s: s.refresh_lease(1),
            lambda s: s.revoke_lease(1),
            lambda s: s.wait("a/", 0, 5.0),
            lambda s: s.ping(),
        ]
        try:
            for call in calls:
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable, match="etcd"):
                    await call(store)
                assert time.monotonic() - t0 < 1.5
        finally:
            await store.close()

    run(body)


def test_a_multi_megabyte_blob_round_trips() -> None:
    async def body() -> None:
        store = EtcdStore([live_endpoint()], uuid.uuid4().hex)
        blob = bytes(range(256)) * (3 * 1024 * 4)  # 3 MiB, near the API's 4 MiB body limit
        try:
            assert (await store.txn([], [Put("blob", blob)])).succeeded
            entry = await store.get("blob")
            assert entry is not None
            assert entry.value == blob
        finally:
            await store.close()

    run(body)


def test_a_prefix_larger_than_one_grpc_answer_reads_whole_as_one_snapshot() -> None:
    """A fleet's records pass gRPC's 16 MiB cap on one answer (10,000 ranks of 80 KV
    regions): the store reads them in pages at one revision. 20 MiB here: 2,560 records of
    8 KiB (written in transactions under etcd's request limit), read whole by both reads."""

    async def body() -> None:
        from app.store.etcd.ranges import RANGE_PAGE

        store = EtcdStore([live_endpoint()], uuid.uuid4().hex)
        value = bytes(range(256)) * 32  # 8 KiB
        keys = [f"groups/g{i:05d}/agents/00000" for i in range(2560)]
        try:
            for at in range(0, len(keys), 128):  # etcd takes 128 operations a transaction
                ops = [Put(k, value) for k in keys[at : at + 128]]
                assert (await store.txn([], ops)).succeeded
            assert len(keys) > 2 * RANGE_PAGE
            snap = await store.range("groups/")
            assert [e.key for e in snap.entries] == keys
            assert all(e.value == value for e in snap.entries)
            whole = await store.entries("groups/")
            assert [e.key for e in whole.entries] == keys
            # The same records at the same revisions; etcd's own revision may have moved (the
            # etcd is shared: another test's lease can end in between, past its grace).
            assert [e.mod_revision for e in whole.entries] == [e.mod_revision for e in snap.entries]
            assert whole.revision >= snap.revision >= max(e.mod_revision for e in snap.entries)
        finally:
            await store.close()

    run(body)


def test_stores_on_different_prefixes_do_not_see_each_other() -> None:
    async def body() -> None:
        a = EtcdStore([live_endpoint()], f"a-{uuid.uuid4().hex}")
        b = EtcdStore([live_endpoint()], f"b-{uuid.uuid4().hex}")
        try:
            await a.txn([], [Put("groups/x/engine", b"a")])
            assert await b.get("groups/x/engine") is None
            assert (await b.range("")).entries == []
            assert [e.key for e in (await a.range("")).entries] == ["groups/x/engine"]
        finally:
            await a.close()
            await b.close()

    run(body)


def test_close_makes_later_calls_answer_store_unavailable() -> None:
    async def body() -> None:
        store = EtcdStore([live_endpoint()], uuid.uuid4().hex)
        await store.ping()
        await store.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await store.get("a")

    run(body)
