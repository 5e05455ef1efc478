"""The watch rows of the contract (docs/api.md "Watching"), through a real registry process on
each store: SQLite, etcd, and etcd over TLS with client certificates and auth. A list answers
its revision and pages one snapshot; a watch from a revision streams every change type in
order, bookmarks while quiet, 410 past the kept history (and a relist recovers); filters and
roles apply, a group leaving or entering a filter is sent as DELETED or ADDED; a revision ahead
of the store answers 410 revision_ahead."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.watch.pages import encode_token
from harness.etcd import SKIP_REASON, etcd_available
from harness.server import RegistryProcess
from tests.app.store.conftest import shared_etcd, shared_secure_etcd
from tests.support.faults import agent_body, open_body
from tests.support.watch import WatchLines

pytestmark = [pytest.mark.store, pytest.mark.timeout(120)]

READER = "reader-" + uuid.uuid4().hex
WORKER = "worker-" + uuid.uuid4().hex
ADMIN = "admin-" + uuid.uuid4().hex
HISTORY = 20  # small: a few dozen requests run past it


@pytest.fixture(scope="module", params=["sqlite", "etcd", "etcds"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp(f"watch-{request.param}")
    env: dict[str, str] = {}
    if request.param == "sqlite":
        url = f"sqlite:///{directory / 'registry.db'}"
    elif not etcd_available():
        pytest.skip(SKIP_REASON)
    elif request.param == "etcd":
        url = shared_etcd().url(f"watch-{uuid.uuid4().hex}")
    else:
        secure = shared_secure_etcd()
        url = secure.cluster.url(f"tls-watch-{uuid.uuid4().hex}")
        env = secure.env()
    tokens = directory / "tokens"
    tokens.write_text(f"reader:{READER}\nworker:{WORKER}\nadmin:{ADMIN}\n")
    args = ["--tokens-file", str(tokens), "--watch-bookmark-s", "0.5"]
    args += ["--watch-history", str(HISTORY), "--sweep-interval-s", "0.2", "--no-access-log"]
    with RegistryProcess(url, args=args, env=env, log_path=directory / "registry.log") as proc:
        yield proc


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def admin(server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0, headers=bearer(ADMIN)) as c:
        yield c


@pytest.fixture(scope="module")
def reader(server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0, headers=bearer(READER)) as c:
        yield c


def gid(prefix: str = "w") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def open_group(c: httpx.Client, group: str, **kw: Any) -> dict[str, Any]:
    resp = c.put(f"/tp-groups/{group}/engine", json=open_body(**kw))
    assert resp.status_code in (200, 201), resp.text
    engine: dict[str, Any] = resp.json()
    return engine


def register(c: httpx.Client, engine: dict[str, Any], rank: int, ttl_s: int = 300) -> None:
    group = engine["group_id"]
    resp = c.put(
        f"/tp-groups/{group}/engine/agents/{rank}",
        json=agent_body(engine["engine_id"], rank, ttl_s=ttl_s),
    )
    assert resp.status_code in (200, 201), resp.text


def listed(c: httpx.Client, **params: Any) -> dict[str, Any]:
    resp = c.get("/tp-groups", params=params)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def walk(c: httpx.Client, limit: int, **params: Any) -> tuple[list[str], int, int]:
    """Every page: the group ids in order, the snapshot's revision, the number of pages."""
    page = listed(c, limit=limit, **params)
    revision, names, pages = page["revision"], [], 0
    while True:
        pages += 1
        assert len(page["groups"]) <= limit
        assert page["revision"] == revision
        names += [g["group_id"] for g in page["groups"]]
        if page["continue"] is None:
            return names, revision, pages
        page = listed(c, limit=limit, **params, **{"continue": page["continue"]})


def test_a_list_answers_the_revision_it_was_read_at_and_sees_every_answered_write(
    admin: httpx.Client,
) -> None:
    before = listed(admin)["revision"]
    group = gid()
    open_group(admin, group)
    after = listed(admin)
    assert after["revision"] > before
    assert group in {g["group_id"] for g in after["groups"]}
    assert after["continue"] is None


def test_pages_are_one_snapshot_whatever_changes_between_them(admin: httpx.Client) -> None:
    mine = sorted(gid("page") for _ in range(5))
    for group in mine:
        open_group(admin, group)
    first = listed(admin, limit=2)
    assert first["continue"] is not None
    # Between the pages: one of the snapshot's groups goes, a new one comes.
    assert admin.delete(f"/tp-groups/{mine[-1]}").status_code == 204
    late = gid("page")
    open_group(admin, late)
    names = [g["group_id"] for g in first["groups"]]
    page = first
    while page["continue"] is not None:
        page = listed(admin, limit=2, **{"continue": page["continue"]})
        assert page["revision"] == first["revision"]
        names += [g["group_id"] for g in page["groups"]]
    assert names == sorted(names)
    assert len(names) == len(set(names))
    assert mine[-1] in names
    assert late not in names
    assert set(mine) <= set(names)


def test_a_role_filter_applies_to_lists_pages_and_watches(admin: httpx.Client) -> None:
    decode, prefill = gid("dec"), gid("pre")
    with WatchLines(admin, {"role": "decode"}) as watch:
        open_group(admin, prefill, role="prefill")
        open_group(admin, decode, role="decode")
        (line,) = watch.changes(1)
        assert (line["type"], line["object"]["group_id"]) == ("ADDED", decode)
    names, _, _ = walk(admin, 1, role="decode")
    assert decode in names
    assert prefill not in names
    assert all(g["role"] == "decode" for g in listed(admin, role="decode")["groups"])
    token = listed(admin, limit=1, role="decode")["continue"]
    if token is not None:  # a token goes with its first page's filters
        assert admin.get("/tp-groups", params={"continue": token, "limit": 1}).status_code == 422


def test_a_watch_reports_every_change_of_a_group_in_revision_order(admin: httpx.Client) -> None:
    group = gid()
    start = listed(admin)["revision"]
    with WatchLines(admin, {"revision": start}) as watch:
        first = open_group(admin, group, tp_size=2)
        register(admin, first, 0)
        register(admin, first, 1, ttl_s=5)
        resp = admin.delete(
            f"/tp-groups/{group}/engine/agents/0", params={"engine_id": first["engine_id"]}
        )
        assert resp.status_code == 204
        lines = watch.changes(4)
        # rank 1's lease (5 s) expires: a change of its own.
        lines += watch.changes(1, timeout_s=15)
        second = open_group(admin, group, tp_size=2)  # a relaunch: a new generation
        assert admin.delete(f"/tp-groups/{group}").status_code == 204
        lines += watch.changes(2)
    mine = [line for line in lines if line["object"]["group_id"] == group]
    kinds = [line["type"] for line in mine]
    assert kinds == ["ADDED", "MODIFIED", "MODIFIED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    ranks = [line["object"]["registered_ranks"] for line in mine]
    assert ranks == [[], [0], [0, 1], [1], [], [], []]
    ready = [line["object"]["ready"] for line in mine]
    assert ready == [False, False, True, False, False, False, False]
    assert [line["object"]["generation"] for line in mine] == [1, 1, 1, 1, 1, 2, 2]
    assert mine[5]["object"]["engine_id"] == second["engine_id"]
    revisions = [line["revision"] for line in mine]
    assert revisions == sorted(set(revisions))
    assert revisions[0] > start


def test_a_watch_from_a_revision_replays_exactly_what_followed_it(admin: httpx.Client) -> None:
    group = gid()
    engine = open_group(admin, group)
    with WatchLines(admin, {"revision": listed(admin)["revision"]}) as watch:
        register(admin, engine, 0)
        open_group(admin, group)  # relaunch
        first, second = watch.changes(2)
    with WatchLines(admin, {"revision": first["revision"]}) as again:
        (replayed,) = again.changes(1)
    assert replayed == second


def test_a_quiet_watch_gets_bookmarks_that_advance_its_revision(
    admin: httpx.Client, reader: httpx.Client
) -> None:
    start = listed(reader)["revision"]
    with WatchLines(reader, {}) as watch:
        first = watch.next(5.0)
        assert first is not None
        assert first["type"] == "BOOKMARK"
        assert first["object"] is None
        assert first["revision"] >= start
        engine = open_group(admin, gid("other"), role="decode")
        marks: list[int] = []
        deadline = time.monotonic() + 10
        while not marks or marks[-1] < listed(reader)["revision"]:
            line = watch.next(max(0.01, deadline - time.monotonic()))
            assert line is not None
            if line["type"] == "BOOKMARK":
                marks.append(line["revision"])
        assert marks[-1] > first["revision"]
        assert engine["group_id"]


def test_a_revision_older_than_the_kept_history_answers_410_and_a_relist_recovers(
    admin: httpx.Client, reader: httpx.Client
) -> None:
    old = listed(reader)
    group = gid("churn")
    engine = open_group(admin, group)
    for n in range(HISTORY + HISTORY // 2):  # relaunches and registrations: a change each
        if n % 2:
            register(admin, engine, 0)
        else:
            engine = open_group(admin, group)
    resp = reader.get("/tp-groups", params={"watch": "true", "revision": old["revision"]})
    assert resp.status_code == 410, resp.text
    problem = resp.json()
    assert problem["code"] == "revision_compacted"
    assert problem["oldest_revision"] > old["revision"]
    stale = listed(reader, limit=1)
    # A relist answers a revision to watch from, and the watch serves it.
    fresh = listed(reader)
    with WatchLines(reader, {"revision": fresh["revision"]}) as watch:
        assert admin.delete(f"/tp-groups/{group}").status_code == 204
        (line,) = watch.changes(1)
        assert (line["type"], line["object"]["group_id"]) == ("DELETED", group)
    assert stale["revision"] >= problem["oldest_revision"]


def test_watching_and_listing_need_the_reader_role(server: RegistryProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10.0) as anonymous:
        resp = anonymous.get("/tp-groups", params={"watch": "true"})
        assert resp.status_code == 401
        assert anonymous.get("/tp-groups").status_code == 401
        wrong = anonymous.get("/tp-groups", params={"watch": "true"}, headers=bearer("x" * 20))
        assert wrong.status_code == 401
    with (
        httpx.Client(base_url=server.url, timeout=10.0, headers=bearer(READER)) as c,
        WatchLines(c, {}) as watch,
    ):
        assert watch.response.status_code == 200
        assert watch.response.headers["content-type"] == "application/x-ndjson"
        line = watch.next(5.0)
        assert line is not None
        assert line["type"] == "BOOKMARK"


def test_watch_parameters_are_checked(reader: httpx.Client) -> None:
    for params in (
        {"watch": "true", "revision": "-1"},
        {"watch": "true", "role": "router"},
        {"limit": "0"},
        {"continue": "not-a-token"},
    ):
        resp = reader.get("/tp-groups", params=params)
        assert resp.status_code == 422, (params, resp.text)
        assert resp.json()["code"] == "invalid_request"


def open_with(c: httpx.Client, group: str, role: str, model: str) -> dict[str, Any]:
    body = open_body(role=role) | {"compat": {"model": model}}
    resp = c.put(f"/tp-groups/{group}/engine", json=body)
    assert resp.status_code in (200, 201), resp.text
    engine: dict[str, Any] = resp.json()
    return engine


def test_a_filtered_watch_sees_a_group_leave_its_filter_as_deleted_and_enter_it_as_added(
    admin: httpx.Client,
) -> None:
    group, model = gid("move"), f"m-{uuid.uuid4().hex[:6]}"
    start = listed(admin)["revision"]
    by_role = WatchLines(admin, {"revision": start, "role": "prefill"})
    by_model = WatchLines(admin, {"revision": start, "model": model})
    with by_role, by_model:
        first = open_with(admin, group, "prefill", model)
        second = open_with(admin, group, "decode", model)  # leaves role=prefill
        third = open_with(admin, group, "prefill", "other")  # back in; leaves model=
        fourth = open_with(admin, group, "prefill", model)  # enters model= again
        roles = [(x["type"], x["object"]["engine_id"]) for x in by_role.changes(4)]
        models = [(x["type"], x["object"]["engine_id"]) for x in by_model.changes(4)]
    # What left the filter is sent as it was, the last time the filter passed it.
    assert roles == [
        ("ADDED", first["engine_id"]),
        ("DELETED", first["engine_id"]),
        ("ADDED", third["engine_id"]),
        ("MODIFIED", fourth["engine_id"]),
    ]
    assert models == [
        ("ADDED", first["engine_id"]),
        ("MODIFIED", second["engine_id"]),
        ("DELETED", second["engine_id"]),
        ("ADDED", fourth["engine_id"]),
    ]
    names, _, _ = walk(admin, 1, model=model)
    assert names == [group]
    assert walk(admin, 1, model=model, role="decode")[0] == []


def test_a_revision_ahead_of_the_store_is_refused_so_the_client_lists_again(
    reader: httpx.Client,
) -> None:
    head = listed(reader)["revision"]
    resp = reader.get("/tp-groups", params={"watch": "true", "revision": head + 1_000_000})
    assert resp.status_code == 410, resp.text
    problem = resp.json()
    assert problem["code"] == "revision_ahead"
    assert problem["store_revision"] >= head
    token = encode_token(head + 1_000_000, "", None)
    resp = reader.get("/tp-groups", params={"limit": 1, "continue": token})
    assert resp.status_code == 410, resp.text
    assert resp.json()["code"] == "revision_ahead"
