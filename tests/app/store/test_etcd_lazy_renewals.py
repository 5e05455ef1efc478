"""Lazy lease renewals on etcd (``REGISTRY_ETCD_RENEW_WINDOW_S``, ``app.store.etcd.journal``):
renewals stay in memory and reach etcd about once per window, shared between replicas by the
renewal journal; a lease renewed through another replica is kept and read live; a replica
killed has its dead ranks ended by ttl + grace and its live ones kept by the replica they
move to, or by its restart. Real etcd, the other replicas real processes; etcd's renewals
counted from its own metrics."""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from app.store import Lease, Put, Unavailable
from app.store.lease_clock import CLOCK
from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from harness.server import RegistryProcess
from tests.support.cancels import losing_first_cancel
from tests.support.faults import node, node_beat, refused_after_deregistration

pytestmark = [pytest.mark.store, pytest.mark.timeout(90)]

if not etcd_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from app.store.etcd.journal import TICK_S  # noqa: E402
from app.store.etcd.store import EtcdStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TTL_S = 2
TP = 8
GRACE_S = 5.0  # the headroom of the kill tests (REGISTRY_LEASE_GRACE_S), kept short

# Another replica: an etcd store in its own process, with the grace and window given, that
# renews the leases given every 0.25 s until killed: a line a round, "ok" or "gone", and the
# renewals of its journal's presence lease so far.
REPLICA = """
import asyncio, sys
from app.store.lease_clock import CLOCK
from app.store.etcd.store import EtcdStore

CLOCK.grace_s, CLOCK.etcd_window_s = float(sys.argv[2]), float(sys.argv[3])

async def main() -> None:
    store = EtcdStore.from_url(sys.argv[1], timeout_s=5.0)
    await store.start()
    leases = [int(i) for i in sys.argv[4].split(",")]
    print("ready", flush=True)
    while True:
        answers = [await store.refresh_lease(i) for i in leases]
        kept = getattr(getattr(store, "_journal", None), "presence_kept", 0)
        print("ok" if all(answers) else "gone", kept, flush=True)
        await asyncio.sleep(0.25)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(Path(tmp_path_factory.mktemp("etcd-lazy")), size=1) as cluster:
        yield cluster


@pytest.fixture
def window() -> Iterator[None]:
    """Lazy renewals, as ``REGISTRY_ETCD_RENEW_WINDOW_S=20`` would set them."""
    saved = CLOCK.etcd_window_s, CLOCK.grace_s
    CLOCK.etcd_window_s = 20.0
    try:
        yield
    finally:
        CLOCK.etcd_window_s, CLOCK.grace_s = saved


def keepalives(cluster: EtcdCluster) -> float:
    """Lease renewals etcd received (every stream's requests)."""
    return cluster.metric("grpc_server_msg_received_total", "LeaseKeepAlive")


def presence_kept(store: EtcdStore) -> int:
    """Renewals of the store's own journal presence lease (none before the journal)."""
    return int(getattr(getattr(store, "_journal", None), "presence_kept", 0))


@asynccontextmanager
async def replica(url: str, leases: list[int]) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        REPLICA,
        url,
        str(GRACE_S),
        str(CLOCK.etcd_window_s),
        ",".join(map(str, leases)),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert await line(proc, 30.0) == "ready"
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def line(proc: asyncio.subprocess.Process, within_s: float = 15.0) -> str:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), within_s)
    assert raw, "the other replica ended"
    return raw.decode().strip()


@pytest.mark.usefixtures("window")
def test_renewals_reach_etcd_about_once_per_window(etcd: EtcdCluster) -> None:
    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        store._window_given = 5.0  # a short window: refreshed twice in the 6 s below
        try:
            lease = await store.grant_lease(TTL_S)
            before = await asyncio.to_thread(keepalives, etcd)
            # A renewal every 0.1 s, each answered at the journal's next write (its tick).
            renewals: list[asyncio.Task[Lease | None]] = []
            started = time.monotonic()
            while time.monotonic() - started < 6.0:
                renewals.append(asyncio.create_task(store.refresh_lease(lease.id)))
                await asyncio.sleep(0.1)
            answers = await asyncio.gather(*renewals)
            revisions = [a.revision for a in answers if a is not None]
            assert len(revisions) == len(answers), "a renewal was refused"
            sent = await asyncio.to_thread(keepalives, etcd) - before
            assert len(answers) >= 30
            assert 1 <= sent <= math.ceil(len(answers) / 10) + 1, (
                f"{len(answers)} renewals sent {sent:g} to etcd"
            )
            assert None not in revisions
            # etcd still keeps it past its logical time and the headroom.
            ttl_left, granted, _, _ = await store._ask_lease(lease.id)
            assert ttl_left >= TTL_S + math.ceil(CLOCK.grace_s) - 1
            assert granted == TTL_S + math.ceil(CLOCK.grace_s) + 5
        finally:
            await store.close()

    asyncio.run(body())


@pytest.mark.usefixtures("window")
def test_a_lease_renewed_in_memory_through_another_replica_is_kept_and_read_live(
    etcd: EtcdCluster,
) -> None:
    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        granter, renewer = EtcdStore.from_url(url), EtcdStore.from_url(url)
        try:
            lease = await granter.grant_lease(TTL_S)
            assert (await granter.txn([], [Put("agent", b"x", lease.id)])).succeeded
            await asyncio.sleep(TICK_S + 0.2)  # the grant is in the journal
            before = await asyncio.to_thread(keepalives, etcd)
            lags = []
            for _ in range(12):  # 6 s: the granter's own figure ran out 4 s ago
                renewed = await renewer.refresh_lease(lease.id)
                assert renewed is not None
                done = time.monotonic()
                # The granter reads it live with its full ttl within a journal tick.
                while (await granter.lease_remaining({lease.id}))[lease.id] < TTL_S - 0.2:
                    assert time.monotonic() - done < TICK_S, "the granter reads an old figure"
                    await asyncio.sleep(0.01)
                lags.append(time.monotonic() - done)
                await asyncio.sleep(0.5)
            last = time.monotonic()
            sent = await asyncio.to_thread(keepalives, etcd) - before
            assert sent <= 1, f"12 renewals in memory sent {sent:g} to etcd"
            assert granter.reaper.ended == 0, "a replica ended a lease another one renews"
            assert [e.key for e in (await granter.range("")).entries] == ["agent"]
            # Not renewed any more: ended at its ttl by the replica it was renewed through.
            while await granter.get("agent") is not None:
                elapsed = time.monotonic() - last
                assert elapsed < TTL_S + 0.5 + 1.5, f"still there {elapsed:.2f} s after"
                await asyncio.sleep(0.05)
            assert time.monotonic() - last > TTL_S - 0.5, "ended before its ttl"
            # etcd deletes the key before the reaper that revoked it counts the end (its
            # answer and the read's reach this one loop in either order): the count, bounded.
            gone = time.monotonic()
            while renewer.reaper.ended + granter.reaper.ended == 0:
                assert time.monotonic() - gone < 2.0, "the key went with no reaper's end"
                await asyncio.sleep(0.01)
            assert (renewer.reaper.ended, granter.reaper.ended) == (1, 0)
            print(f"reads on the granter agreed after {max(lags) * 1000:.0f} ms at most")
            print(f"the end counted {(time.monotonic() - gone) * 1000:.0f} ms after the key went")
        finally:
            await granter.close()
            await renewer.close()

    asyncio.run(body())


async def watch_live(store: EtcdStore, key: str, seconds: float) -> None:
    """``key`` read live on ``store`` every 0.1 s for ``seconds``."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        entries = (await store.range(key)).entries
        assert entries, f"a live rank lapsed {time.monotonic() - started:.1f} s in"
        await asyncio.sleep(0.1)


@pytest.mark.usefixtures("window")
def test_a_killed_replica_s_dead_ranks_end_by_the_grace_and_live_ones_move(
    etcd: EtcdCluster,
) -> None:
    CLOCK.grace_s = GRACE_S

    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        survivor = EtcdStore.from_url(url, timeout_s=5.0)
        try:
            dead, live = await survivor.grant_lease(TTL_S), await survivor.grant_lease(TTL_S)
            puts = [Put("dead", b"x", dead.id), Put("live", b"x", live.id)]
            assert (await survivor.txn([], puts)).succeeded
            async with replica(url, [dead.id, live.id]) as other:
                for _ in range(8):  # 2 s: renewed there, in memory
                    assert (await line(other)).startswith("ok")
                other.send_signal(signal.SIGKILL)
                await other.wait()
            killed = time.monotonic()
            before = await asyncio.to_thread(keepalives, etcd) + presence_kept(survivor)

            async def renew_live() -> None:  # the node's heartbeats move to the survivor
                while True:
                    assert await survivor.refresh_lease(live.id) is not None
                    await asyncio.sleep(0.5)

            renewing = asyncio.create_task(renew_live())
            try:
                while await survivor.get("dead") is not None:
                    elapsed = time.monotonic() - killed
                    assert elapsed < TTL_S + GRACE_S + 2.0, f"dead rank there {elapsed:.1f} s"
                    assert (await survivor.range("live")).entries, "the live rank lapsed"
                    await asyncio.sleep(0.1)
                assert time.monotonic() - killed > GRACE_S - 2.0, "adopted before the grace"
                await watch_live(survivor, "live", 3.0)
            finally:
                renewing.cancel()
            sent = await asyncio.to_thread(keepalives, etcd) - before - presence_kept(survivor)
            assert sent <= 3, f"the survivor's renewals sent {sent:g} to etcd"
            assert survivor.reaper.ended == 1
        finally:
            await survivor.close()

    asyncio.run(body())


@pytest.mark.usefixtures("window")
def test_a_replica_restarted_within_the_grace_keeps_its_live_ranks(etcd: EtcdCluster) -> None:
    CLOCK.grace_s = GRACE_S

    async def body() -> None:
        url = etcd.url(uuid.uuid4().hex)
        observer = EtcdStore.from_url(url, timeout_s=5.0)
        try:
            lease = await observer.grant_lease(TTL_S)
            assert (await observer.txn([], [Put("live", b"x", lease.id)])).succeeded
            async with replica(url, [lease.id]) as first:
                for _ in range(8):
                    assert (await line(first)).startswith("ok")
                first.send_signal(signal.SIGKILL)
                await first.wait()
            # Its restart takes about a second (the import): the lease is kept meanwhile,
            # and by the new process from its first renewal on, past the old one's grace.
            async with replica(url, [lease.id]) as again:
                answer = await line(again)  # on etcd: the new process knew nothing of it
                before = await asyncio.to_thread(keepalives, etcd) + presence_kept(observer)
                watching = asyncio.create_task(watch_live(observer, "live", GRACE_S + TTL_S))
                first_kept = int(answer.split()[1])
                while not watching.done():
                    answer = await line(again)
                    assert answer.split()[0] == "ok"
                await watching
                kept = int(answer.split()[1]) - first_kept
            sent = await asyncio.to_thread(keepalives, etcd) - before - presence_kept(observer)
            sent -= kept
            assert sent <= 2, f"the restarted replica's renewals sent {sent:g} to etcd"
            assert observer.reaper.ended == 0
        finally:
            await observer.close()

    asyncio.run(body())


def test_a_registry_s_heartbeats_stay_in_memory_and_answer_as_before(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """Through a real registry process with ``REGISTRY_ETCD_RENEW_WINDOW_S``: node heartbeats
    are answered from the watch feed at the journal write's revision (no range read, no
    renewal on etcd), and one right after a deregistration still names the rank."""
    env = {"REGISTRY_ETCD_RENEW_WINDOW_S": "110"}
    log = tmp_path / "registry.log"
    with (
        RegistryProcess(etcd.url(uuid.uuid4().hex), log_path=log, env=env) as proc,
        httpx.Client(base_url=proc.url, timeout=10) as http,
    ):
        groups = {f"lazy-{i}": node(http, f"lazy-{i}", range(TP)) for i in range(5)}
        ranges, renewals = etcd.metric("grpc_server_msg_received_total", "Range"), keepalives(etcd)
        for _ in range(4):
            for gid, eid in groups.items():
                answer = node_beat(http, gid, eid, list(range(TP)))
                assert answer.status_code == 200, answer.text
        ranges = etcd.metric("grpc_server_msg_received_total", "Range") - ranges
        renewals = keepalives(etcd) - renewals
        assert ranges <= 2, f"20 heartbeats made {ranges:g} range reads"
        assert renewals <= 2, f"20 heartbeats sent {renewals:g} renewals to etcd"
        for i in range(5):  # rank 0 gone, its lease held on by rank 1
            refused_after_deregistration(http, f"dereg-{i}", i)


@pytest.mark.usefixtures("window")
def test_renewals_waiting_for_a_journal_write_that_never_lands_fail_by_their_deadline(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's writes made to hang (etcd stuck): 20 renewals waiting for the next write
    each fail, naming the cause, within the tick + the store's timeout (one deadline for all
    of them, not a timer each), and a renewal after etcd answers again is written."""

    async def body() -> None:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=1.0)
        try:
            lease = await store.grant_lease(TTL_S)
            journal = store._journal
            assert journal is not None
            put = journal._put
            stuck = asyncio.Event()

            async def hung(value: bytes) -> int:
                await stuck.wait()
                return await put(value)

            monkeypatch.setattr(journal, "_put", hung)
            started = time.monotonic()
            answers = await asyncio.gather(
                *(store.refresh_lease(lease.id) for _ in range(20)), return_exceptions=True
            )
            waited = time.monotonic() - started
            assert all(isinstance(a, Unavailable) for a in answers), answers
            assert "wrote nothing within" in str(answers[0])
            assert waited <= TICK_S + 1.0 + 0.5, f"the renewals waited {waited:.2f} s"
            stuck.set()  # etcd answers again: the hung write lands, then the next one
            monkeypatch.setattr(journal, "_put", put)
            renewed = await asyncio.wait_for(store.refresh_lease(lease.id), 5.0)
            assert renewed is not None
            assert renewed.revision is not None
        finally:
            await store.close()

    asyncio.run(body())


@pytest.mark.usefixtures("window")
def test_a_closed_store_s_journal_ends_though_its_watch_lost_a_cancellation(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's watch loops on ``wait_for``, which on Python 3.11 loses a cancellation
    arriving with its result (``app/store/tasks.py``). Its stream made to lose the first one:
    the store's close still ends the journal's tasks (it left the watch running before)."""
    from app.store.etcd import journal as journal_module

    lost: list[bool] = []
    lossy = losing_first_cancel(journal_module.etcd_watch.follow, lost)
    monkeypatch.setattr(journal_module.etcd_watch, "follow", lossy)

    async def body() -> list[asyncio.Task[None]]:
        store = EtcdStore.from_url(etcd.url(uuid.uuid4().hex), timeout_s=5.0)
        lease = await store.grant_lease(TTL_S)
        assert await store.refresh_lease(lease.id) is not None
        journal = store._journal
        assert journal is not None
        await asyncio.wait_for(store.close(), 10.0)
        await asyncio.sleep(0.1)
        return [t for t in journal._tasks if not t.done()]

    running = asyncio.run(body())
    assert lost, "the journal's watch was never cancelled while it waited"
    assert not running, f"{len(running)} of the journal's tasks ran on after the store closed"
