"""`release.Follower`'s judgement, fed events directly: a handshake can read an engine newer
than what the watch has said yet (the watch lags by a few ms), and that engine must not be
released on the older word; a word that is still true once the watch has caught up
(`SETTLE_S`) releases it; a release vLLM is not ready for is tried again on one loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.server import free_port
from registry_client.models import Engine, Handshake
from workers.vllm_plugin import release
from workers.vllm_plugin.settings import PluginSettings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SETTLE_S = 0.5


def engine(generation: int, *, ready: bool = True, group: str = "pf") -> Engine:
    return Engine(
        group_id=group,
        engine_id=f"e{generation}",
        generation=generation,
        launch_id="l",
        tp_size=1,
        role="prefill",
        compat={"model": "m"},
        ready=ready,
        registered_ranks=[0] if ready else [],
        missing_ranks=[] if ready else [0],
    )


def planned(generation: int) -> Handshake:
    return Handshake(f"e{generation}", "pf", generation, 1, 1, [])


class Released:
    def __init__(self, refuse_first: int = 0) -> None:
        self.tries: dict[str, int] = {}
        self.done: list[tuple[str, str]] = []
        self.refuse_first = refuse_first

    def hand(self, vllm_engine_id: str) -> bool:
        self.tries[vllm_engine_id] = self.tries.get(vllm_engine_id, 0) + 1
        return self.tries[vllm_engine_id] > self.refuse_first

    def on_release(self, followed: release.Followed, kind: str, _why: str) -> None:
        self.done.append((followed.engine_id, kind))


@pytest.fixture
def make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., release.Follower]]:
    monkeypatch.setattr(release, "SETTLE_S", SETTLE_S)
    made: list[release.Follower] = []
    # Nobody listens there: the node's watch retries quietly, the test feeds the events.
    settings = PluginSettings(url=f"http://127.0.0.1:{free_port()}", group="decode-0")

    def make_follower(released: Released) -> release.Follower:
        follower = release.Follower(
            settings,
            released.hand,
            released.on_release,
            model="m",
            node="n",
            directory=tmp_path,
        )
        made.append(follower)
        return follower

    yield make_follower
    for follower in made:
        follower.close()


def until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_handshake_newer_than_the_watchs_word_is_not_released(
    make: Callable[[Released], release.Follower],
) -> None:
    released = Released()
    follower = make(released)
    follower.apply("SYNC", [engine(1)])  # the watch has not heard of generation 2 yet
    follower.follow("e2", planned(2))
    follower.apply("ADDED", [engine(2, ready=False)])  # on its way: no agent yet
    follower.apply("MODIFIED", [engine(2)])  # ready, as the handshake read it
    time.sleep(SETTLE_S * 2)
    assert released.done == []
    follower.apply("MODIFIED", [engine(3, ready=False)])  # relaunched: superseded at once
    assert released.done == [("e2", "superseded")]


def test_a_word_still_true_once_the_watch_caught_up_releases_it(
    make: Callable[[Released], release.Follower],
) -> None:
    released = Released()
    follower = make(released)
    follower.apply("SYNC", [engine(2, ready=False)])  # its lease lapsed after the handshake
    started = time.monotonic()
    follower.follow("e2", planned(2))
    assert released.done == []
    assert until(lambda: released.done == [("e2", "not_ready")], 10 * SETTLE_S)
    assert time.monotonic() - started >= SETTLE_S * 0.9


def test_a_release_vllm_was_not_ready_for_is_tried_again_on_one_loop(
    make: Callable[[Released], release.Follower],
) -> None:
    released = Released(refuse_first=3)
    follower = make(released)
    follower.apply("SYNC", [engine(1)])
    follower.follow("e1", planned(1))
    follower.apply("MODIFIED", [engine(2, ready=False)])
    assert until(lambda: released.done == [("e1", "superseded")], 10)
    assert released.tries == {"e1": 4}
