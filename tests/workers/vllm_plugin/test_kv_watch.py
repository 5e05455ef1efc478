"""The decode worker's KV-pull watch (workers.vllm_plugin.kv_watch), without vLLM: the stage it
names from the connector's bookkeeping, when it speaks, and that a failing watch never fails a
step. The real connector's bookkeeping is read in the real-vLLM tier (test_vllm_pd.py)."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from workers.vllm_plugin.kv_watch import MARK, KvWatch, Waiting, attach, waiting_of

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _meta(engine_id: str) -> Any:
    return SimpleNamespace(remote=SimpleNamespace(engine_id=engine_id))


def test_the_stage_is_read_from_the_connectors_bookkeeping() -> None:
    worker = SimpleNamespace(
        _recving_metadata={"a": _meta("e1"), "b": _meta("e2"), "c": _meta("e3")},
        _recving_transfers={"a": [11, 12]},
        _handshake_futures={"e2": object()},
    )
    stages = {w.req_id: w.stage for w in waiting_of(worker)}
    assert stages["a"].startswith("READ posted: 2 NIXL READ(s) still in progress")
    assert stages["b"].startswith("handshake pending")
    assert stages["c"].startswith("not posted")


def test_a_wait_is_said_past_warn_s_then_every_every_s_and_its_end() -> None:
    said: list[str] = []
    clock = Clock()
    watch = KvWatch(warn_s=10, every_s=30, log=said.append, clock=clock)
    posted = Waiting("r1", "e1", 2, False)
    for step in range(0, 80, 5):
        clock.now = 100.0 + step
        watch.observe([posted])
    # At 10 s, 40 s and 70 s; nothing before the first 10 s.
    assert [line.split("waited ")[1].split(" s")[0] for line in said] == ["10.0", "40.0", "70.0"]
    assert all(line.startswith(MARK) and "from engine e1" in line for line in said)
    clock.now = 181.0
    watch.observe([])
    assert said[-1] == f"{MARK} for request r1 ended after 81.0 s"
    assert not watch.first_seen
    assert not watch.last_said


def test_a_short_wait_says_nothing() -> None:
    said: list[str] = []
    clock = Clock()
    watch = KvWatch(warn_s=10, log=said.append, clock=clock)
    watch.observe([Waiting("r1", "e1", 1, False)])
    clock.now += 3
    watch.observe([])
    assert said == []


def test_attach_wraps_the_poll_and_a_broken_watch_never_fails_it() -> None:
    calls: list[str] = []

    def poll() -> str:
        calls.append("poll")
        return "results"

    class Broken(KvWatch):
        def observe(self, waiting: Iterable[Waiting]) -> None:
            raise RuntimeError("boom")

    worker = SimpleNamespace(_recving_metadata={"x": _meta("e")}, get_transfer_results=poll)
    connector = SimpleNamespace(connector_worker=worker)
    broken = Broken()
    assert attach(connector, broken)
    assert worker.get_transfer_results() == "results"
    assert calls == ["poll"]
    # A connector without a pull worker (or another connector) is left alone.
    assert not attach(SimpleNamespace(), KvWatch())
    assert not attach(SimpleNamespace(connector_worker=SimpleNamespace()), KvWatch())
