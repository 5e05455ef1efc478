"""The workers' watch iterators (registry_client/watch.py) against a real registry process: a SYNC
first, then each change once and in order, sync and async; a relist on 410; a lost registry
surfaces as WatchLost after its deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.server import RegistryProcess, free_port
from registry_client.client import RegistryClient
from registry_client.errors import InvalidRequest, WatchLost
from registry_client.watch import BACKOFF_BASE_S, Cursor, WatchEvent
from tests.support.faults import agent_body

pytestmark = [pytest.mark.api, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp("watch-client")
    args = ["--watch-bookmark-s", "0.5", "--watch-history", "20", "--no-access-log"]
    url = f"sqlite:///{directory / 'registry.db'}"
    with RegistryProcess(url, args=args, log_path=directory / "registry.log") as proc:
        yield proc


@pytest.fixture
def client(server: RegistryProcess) -> Iterator[RegistryClient]:
    with RegistryClient(server.url, timeout_s=10.0) as c:
        yield c


def gid() -> str:
    return f"wc-{uuid.uuid4().hex[:10]}"


def take(events: Iterator[WatchEvent], n: int, timeout_s: float = 10.0) -> list[WatchEvent]:
    deadline = time.monotonic() + timeout_s
    out: list[WatchEvent] = []
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {out} within {timeout_s} s"
        out.append(next(events))
    return out


def test_a_watch_syncs_then_yields_each_change_once_in_order(client: RegistryClient) -> None:
    before = gid()
    client.open_engine(before, launch_id="l1", tp_size=1, role="prefill")
    events = iter(client.watch(idle_timeout_s=5))
    (sync,) = take(events, 1)
    assert sync.type == "SYNC"
    assert before in {g.group_id for g in sync.groups}
    group = gid()
    engine, _ = client.open_engine(group, launch_id="l1", tp_size=1, role="decode")
    client.request(
        "PUT", f"/tp-groups/{group}/engine/agents/0", json=agent_body(engine.engine_id, 0)
    )
    client.delete_group(group)
    changes = [e for e in take(events, 3) if e.engine and e.engine.group_id == group]
    assert [e.type for e in changes] == ["ADDED", "MODIFIED", "DELETED"]
    assert changes[1].engine is not None
    assert changes[1].engine.ready
    assert [e.revision for e in changes] == sorted({e.revision for e in changes})
    assert changes[0].revision > sync.revision


def test_the_async_watch_yields_the_same_changes(client: RegistryClient) -> None:
    group = gid()

    async def main() -> list[WatchEvent]:
        got: list[WatchEvent] = []
        async with asyncio.timeout(15):
            watch = client.awatch(role="decode", idle_timeout_s=5).__aiter__()
            got.append(await anext(watch))
            await asyncio.to_thread(
                client.open_engine, gid(), launch_id="x", tp_size=1, role="prefill"
            )
            await asyncio.to_thread(
                client.open_engine, group, launch_id="l1", tp_size=1, role="decode"
            )
            got.append(await anext(watch))
            await watch.aclose()  # type: ignore[attr-defined]
        return got

    sync, added = asyncio.run(main())
    assert sync.type == "SYNC"
    assert all(g.role == "decode" for g in sync.groups)
    assert added.type == "ADDED"
    assert added.engine is not None
    assert added.engine.group_id == group  # the prefill group is filtered out


def test_a_watch_from_a_compacted_revision_lists_again(client: RegistryClient) -> None:
    group = gid()
    engine, _ = client.open_engine(group, launch_id="l0", tp_size=1, role="prefill")
    start = client.request("GET", "/tp-groups").json()["revision"]
    for n in range(30):  # past the kept history (20 changes)
        engine, _ = client.open_engine(group, launch_id=f"l{n + 1}", tp_size=1, role="prefill")
    events = iter(client.watch(revision=start, idle_timeout_s=5))
    (sync,) = take(events, 1)
    assert sync.type == "SYNC"
    assert sync.revision > start
    current = [g for g in sync.groups if g.group_id == group]
    assert [g.engine_id for g in current] == [engine.engine_id]
    client.delete_group(group)
    (deleted,) = take(events, 1)
    assert deleted.type == "DELETED"


def test_a_lost_registry_raises_watch_lost_after_its_deadline() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with RegistryClient(nobody, timeout_s=0.5, connect_timeout_s=0.2) as c:
        started = time.monotonic()
        with pytest.raises(WatchLost) as lost:
            next(iter(c.watch(revision=0, lost_after_s=1.0)))
        took = time.monotonic() - started
    assert 1.0 <= took < 6.0
    assert lost.value.urls == [nobody]


def test_a_refusal_is_raised_at_once(client: RegistryClient) -> None:
    with pytest.raises(InvalidRequest):
        next(iter(client.watch(revision=-5)))


def test_the_cursor_resumes_a_revision_that_changed_several_groups_without_doubles() -> None:
    cursor = Cursor(10)

    def line(kind: str, revision: int, group: str = "") -> dict[str, object]:
        engine = {"group_id": group, "engine_id": "e", "generation": 1, "tp_size": 1}
        return {"type": kind, "revision": revision, "object": engine | {"role": "prefill"}}

    assert cursor.accept(line("ADDED", 11, "a")) is not None
    assert cursor.resume_from == 10  # revision 11 may have more groups
    assert cursor.accept(line("ADDED", 11, "a")) is None  # resumed: a was delivered
    assert cursor.accept(line("ADDED", 11, "b")) is not None
    assert cursor.accept(line("MODIFIED", 12, "a")) is not None
    assert cursor.done == 11
    assert cursor.accept({"type": "BOOKMARK", "revision": 12, "object": None}) is not None
    assert cursor.resume_from == 12
    assert cursor.accept(line("MODIFIED", 12, "b")) is None  # at or before done


def test_watchers_that_lost_a_replica_come_back_spread_by_full_jitter() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with RegistryClient(nobody, timeout_s=0.5) as c:
        pauses = []
        for _ in range(200):
            watch = c.watch(revision=0)
            watch.failed("the stream ended")  # each one's first failure
            pauses.append(watch.pause())
    assert all(0 <= p < BACKOFF_BASE_S for p in pauses), max(pauses)
    buckets = Counter(int(p / BACKOFF_BASE_S * 10) for p in pauses)
    # Full jitter: about 20 in each tenth of the window (the old fixed 0.1 s: all 200 in one).
    assert max(buckets.values()) <= 60, sorted(buckets.items())
    assert len(buckets) == 10, sorted(buckets.items())


def test_a_watch_on_a_registry_restarted_on_a_fresh_file_lists_again(tmp_path: Path) -> None:
    """The hostile run of issue 38 item 2: the client stands at a revision the new store has
    not reached (some 50 against 2); the registry refuses it (410 revision_ahead) and the
    watch lists again, seeing the new store's groups and none of the old one's."""
    port = free_port()
    args = ["--watch-bookmark-s", "0.5", "--no-access-log"]

    def serve(name: str) -> RegistryProcess:
        store = f"sqlite:///{tmp_path / f'{name}.db'}"
        return RegistryProcess(store, port=port, args=args, log_path=tmp_path / f"{name}.log")

    old_groups, new_groups = [gid() for _ in range(2)], [gid() for _ in range(2)]
    with RegistryClient(f"http://127.0.0.1:{port}", timeout_s=10.0) as client:
        with serve("old"):
            for n in range(18):  # two changes a launch: revision 36
                engine, _ = client.open_engine(
                    old_groups[n % 2], launch_id=f"l{n}", tp_size=1, role="prefill"
                )
                client.request(
                    "PUT",
                    f"/tp-groups/{old_groups[n % 2]}/engine/agents/0",
                    json=agent_body(engine.engine_id, 0),
                )
            events = iter(client.watch(bookmarks=True, idle_timeout_s=5, lost_after_s=60))
            (sync,) = take(events, 1)
            assert sync.revision >= 36
        with serve("new"):
            for group in new_groups:
                client.open_engine(group, launch_id="l0", tp_size=1, role="prefill")
            head = client.request("GET", "/tp-groups").json()["revision"]
            assert head < sync.revision
            deadline = time.monotonic() + 20
            relisted = None
            while relisted is None:
                assert time.monotonic() < deadline, "no new SYNC within 20 s (bookmarks only)"
                event = next(events)
                relisted = event if event.type == "SYNC" else None
            assert {g.group_id for g in relisted.groups} == set(new_groups)
            assert relisted.revision == head
            later = gid()
            client.open_engine(later, launch_id="l0", tp_size=1, role="prefill")
            added = next(e for e in events if e.type != "BOOKMARK")
            assert (added.type, added.engine and added.engine.group_id) == ("ADDED", later)


def test_a_watch_resumes_a_restarted_sqlite_registry_at_its_final_line_without_listing(
    tmp_path: Path,
) -> None:
    """SIGTERM ends each stream with an ERROR line at the revision it had sent everything up
    to; the registry restarted on the same file starts its history there. The watch resumes
    from that line's revision: no new SYNC, the next change arrives (it resumed from its last
    change's revision minus one before, which the new history refused: every watcher listed
    the whole fleet again)."""
    port = free_port()
    store = f"sqlite:///{tmp_path / 'registry.db'}"
    args = ["--watch-bookmark-s", "0.5", "--no-access-log"]
    groups = [gid() for _ in range(3)]
    with RegistryClient(f"http://127.0.0.1:{port}", timeout_s=10.0) as client:
        with RegistryProcess(store, port=port, args=args, log_path=tmp_path / "one.log"):
            events = iter(client.watch(idle_timeout_s=5, lost_after_s=60))
            (sync,) = take(events, 1)
            for group in groups:  # one change each, the last one seen by the watch
                client.open_engine(group, launch_id="l0", tp_size=1, role="prefill")
            assert [e.engine and e.engine.group_id for e in take(events, 3)] == groups
        with RegistryProcess(store, port=port, args=args, log_path=tmp_path / "two.log"):
            later = gid()
            client.open_engine(later, launch_id="l0", tp_size=1, role="prefill")
            (after,) = take(events, 1, timeout_s=20)
    assert sync.type == "SYNC"
    assert (after.type, after.engine and after.engine.group_id) == ("ADDED", later)
