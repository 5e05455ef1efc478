"""router-sync's watch across a registry restarted on the same SQLite file, in the history
of `tests/app/api/test_router_sync.py` (groups published, a prefill relaunched, the
registry stopped and started, then a decode relaunched at once with a 5 s lease nobody
renews). The watch's pauses are held by the test (`Gate`), so each interleaving runs on
purpose, not by the draw of the back-off's jitter.

When the watch comes back only after that lease lapsed (its jittered back-off allows up to
8 s; `test_router_sync` lost that draw about once in ten runs), it still delivers every
change once, in order, without listing again: the open, the registration, the publication
and the lapse. Each round offers what the registry holds at that round, so the relaunched
decode is rightly never offered: it was gone before router-sync heard of it."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from harness.serving_fleet import one_rank_agent
from registry_client.backoff import Backoff
from registry_client.client import RegistryClient
from registry_client.router_sync.offers import Groups, offer
from registry_client.router_sync.sync import follow
from registry_client.watch import GroupWatch, WatchEvent

pytestmark = [pytest.mark.api, pytest.mark.timeout(120)]
COMPAT = {"model": "tiny", "block_size": 16, "dtype": "bfloat16"}
TTL_S = 5  # the registry's shortest lease


def wait_for(check: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s"
        time.sleep(0.05)


class Gate(Backoff):
    """The watch's pauses: each lasts until the test opens the gate (60 s at most)."""

    def __init__(self) -> None:
        super().__init__(base_s=0.05, cap_s=0.05)
        self.opened = threading.Event()
        self.held = 0  # pauses asked while closed

    def next(self, retry_after_s: float | None = None) -> float:
        self.held += not self.opened.is_set()
        self.opened.wait(60)
        return 0.0


class Gated:
    """A client whose watches pause on ``gate`` (router-sync's `follow` takes any client)."""

    def __init__(self, client: RegistryClient, gate: Gate) -> None:
        self.client, self.gate, self.url = client, gate, client.url

    def watch(self, **kwargs: Any) -> GroupWatch:
        return self.client.watch(**kwargs, backoff=self.gate)


class Recorded(Groups):
    """`Groups` that keep every event the watch gave them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[WatchEvent] = []

    def apply(self, event: Any) -> None:
        self.events.append(event)
        super().apply(event)


def launch(http: httpx.Client, gid: str, role: str, ttl_s: int = 600) -> str:
    """Open a generation, register its rank 0, publish it: its engine id."""
    body = {"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": role, "compat": COMPAT}
    engine_id = str(http.put(f"/tp-groups/{gid}/engine", json=body).json()["engine_id"])
    agent = one_rank_agent(engine_id, f"{engine_id}-0", ttl_s)
    assert http.put(f"/tp-groups/{gid}/engine/agents/0", json=agent).status_code == 201
    url = f"http://127.0.0.1:{40000 + len(gid)}"
    serving = {"engine_id": engine_id, "url": url, "model": "tiny"}
    assert http.put(f"/tp-groups/{gid}/engine/serving", json=serving).status_code == 200
    return engine_id


def group(http: httpx.Client, gid: str) -> dict[str, Any]:
    return dict(http.get(f"/tp-groups/{gid}/engine").json())


def head(http: httpx.Client) -> int:
    return int(http.get("/tp-groups", params={"limit": 1}).json()["revision"])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    store = f"sqlite:///{tmp_path / 'registry.db'}"
    args = ["--watch-bookmark-s", "0.5"]
    with RegistryProcess(store, args=args, log_path=tmp_path / "registry.log") as proc:
        yield proc


def test_a_watch_back_after_the_lapse_delivers_every_change_and_offers_the_present(
    registry: RegistryProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="registry_client.watch")
    gate, groups, stop = Gate(), Recorded(), threading.Event()
    gate.opened.set()
    with (
        RegistryClient(registry.url, timeout_s=10.0) as client,
        httpx.Client(base_url=registry.url, timeout=10.0) as http,
    ):
        for gid, role in (("prefill-a", "prefill"), ("decode-a", "decode")):
            launch(http, gid, role)
        watcher = threading.Thread(
            target=follow, args=(Gated(client, gate), groups, stop, None, 60.0), daemon=True
        )
        watcher.start()
        try:
            wait_for(groups.synced.is_set, 10, "the watch's first list")
            launch(http, "prefill-a", "prefill")
            before = head(http)
            wait_for(lambda: groups.revision >= before, 10, f"the watch at revision {before}")
            seen = len(groups.events)

            gate.opened.clear()
            registry.stop()
            registry.start()
            d2 = launch(http, "decode-a", "decode", ttl_s=TTL_S)
            published = head(http)
            # The lapsed lease's keys deleted (a revision of their own, by the sweep).
            wait_for(lambda: head(http) > published, TTL_S + 5, "the lease lapsed")
            assert not group(http, "decode-a")["ready"]
            gate.opened.set()
            last = head(http)
            wait_for(lambda: groups.revision >= last, 15, f"the watch at revision {last}")
        finally:
            stop.set()
            gate.opened.set()
            watcher.join(timeout=30)

    after = [e for e in groups.events[seen:] if e.type != "BOOKMARK"]
    assert [e.type for e in after if e.type == "SYNC"] == [], "the watch listed again"
    d2_events = [e.engine for e in after if e.engine and e.engine.engine_id == d2]
    # Each change of the relaunched decode once, in order, each at the state it made.
    assert [(e.ready, bool(e.raw.get("serving"))) for e in d2_events] == [
        (False, False),  # opened
        (True, False),  # rank 0 registered
        (True, True),  # published
        (False, True),  # the lease lapsed
    ]
    revisions = [e.revision for e in after]
    assert revisions == sorted(set(revisions))
    # The lapse is the last change of a group; the store's head may be past it by the
    # lease_expired event's own write (under events/, recorded as the sweep ends the lease).
    assert published < revisions[-1] <= last
    assert after[-1].engine is not None
    assert after[-1].engine.engine_id == d2
    assert gate.held > 0
    assert _back(caplog), caplog.text

    offered, left_out = offer(groups.snapshot())
    assert [o.group_id for o in offered] == []
    assert left_out["decode-a"] == "not ready (missing ranks [0])"


def _back(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.getMessage().startswith("watch: back on ") for r in caplog.records)
