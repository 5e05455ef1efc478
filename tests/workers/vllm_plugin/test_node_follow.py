"""Decoders follow the registry one stream a node (`workers.vllm_plugin.node_follow`): four
decode worker processes of one node against a real registry process hold one watch between
them (the registry's ``registry_watchers`` gauge), every one of them releases a relaunched
prefill's engine, and when the leader is killed another takes over and a relaunch made in
between still reaches every survivor, exactly once each."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from registry_client.models import Engine
from tests.support.faults import agent_body
from tests.workers.vllm_plugin.decode_checks import metric
from workers.tools.procs import Proc

pytestmark = [pytest.mark.api, pytest.mark.timeout(90)]

WORKERS = 4
MODEL = "m-follow"
FAIL_FIRST = 2  # each engine's release is "not stored yet" twice: the retry loop's case
LEADS = re.compile(r"worker (\d+) leads node")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    args = ["--watch-bookmark-s", "0.5", "--no-access-log", "--log-level", "warning"]
    store = f"sqlite:///{tmp_path / 'registry.db'}"
    with RegistryProcess(store, args=args, log_path=tmp_path / "registry.log") as proc:
        yield proc


class Worker:
    def __init__(self, n: int, cmd: list[str], log: Path) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = Proc(f"decode-{n}", cmd, os.environ, log, echo=self._echo)

    def _echo(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def saw(self, prefix: str) -> list[str]:
        with self._lock:
            return [line for line in self.lines if line.startswith(prefix)]

    def leads(self) -> bool:
        with self._lock:
            return any(LEADS.search(line) for line in self.lines)


def until(done: Callable[[], bool], timeout_s: float, what: str, workers: list[Worker]) -> float:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout_s:
            tails = "\n".join(f"{w.proc.name}: {w.lines[-8:]}" for w in workers)
            raise AssertionError(f"{what} not within {timeout_s} s\n{tails}")
        time.sleep(0.05)
    return time.monotonic() - started


def launch(client: RegistryClient, group: str, model: str = MODEL) -> Engine:
    """A prefill launch of TP 1, ready (its rank registered)."""
    engine, _ = client.open_engine(
        group, launch_id=uuid.uuid4().hex, tp_size=1, role="prefill", compat={"model": model}
    )
    client.request(
        "PUT", f"/tp-groups/{group}/engine/agents/0", json=agent_body(engine.engine_id, 0)
    )
    return engine


def test_a_node_holds_one_watch_and_survives_its_leaders_death(
    registry: RegistryProcess, tmp_path: Path
) -> None:
    prefill = f"pf-{uuid.uuid4().hex[:6]}"
    with RegistryClient(registry.url, timeout_s=10.0) as client:
        first = launch(client, prefill)
        other = f"other-{uuid.uuid4().hex[:6]}"
        launch(client, other, model="m-other")
        cmd = [
            sys.executable,
            "-m",
            "tests.workers.vllm_plugin.node_follow_main",
            registry.url,
            "decode-0",
            "node-a/0",
            str(tmp_path),
            MODEL,
            prefill,
            str(FAIL_FIRST),
        ]
        workers = [Worker(n, cmd, tmp_path / f"decode-{n}.log") for n in range(WORKERS)]
        try:
            until(
                lambda: all(w.saw(f"FOLLOW {first.engine_id}") for w in workers),
                30,
                "every worker following the prefill",
                workers,
            )
            # One stream for the node (each worker's own would be 4).
            until(
                lambda: (
                    metric(registry.url, "registry_watchers") == 1
                    and sum(w.leads() for w in workers) == 1
                ),
                15,
                "one watch, one leader",
                workers,
            )
            time.sleep(1.0)  # no other worker opens its own meanwhile
            assert metric(registry.url, "registry_watchers") == 1
            # Filtered by the model on the server: another model's relaunch sends nothing.
            sent = metric(registry.url, "registry_watch_events_sent_total")
            launch(client, other, model="m-other")
            time.sleep(0.5)
            assert metric(registry.url, "registry_watch_events_sent_total") == sent

            second = launch(client, prefill)  # relaunched: every worker releases `first`
            until(
                lambda: metric(registry.url, "registry_watch_events_sent_total") > sent,
                10,
                "the relaunch of the node's model sent",
                workers,
            )
            until(
                lambda: (
                    all(w.saw(f"RELEASED {first.engine_id} superseded") for w in workers)
                    and all(w.saw(f"FOLLOW {second.engine_id}") for w in workers)
                ),
                20,
                "the relaunch released on every worker",
                workers,
            )

            (leader,) = [w for w in workers if w.leads()]
            leader.proc.signal(signal.SIGKILL)
            third = launch(client, prefill)  # while the node has no leader
            survivors = [w for w in workers if w is not leader]
            took = until(
                lambda: all(w.saw(f"RELEASED {second.engine_id} superseded") for w in survivors),
                20,
                "the relaunch after the leader's death released on every survivor",
                workers,
            )
            until(
                lambda: (
                    sum(w.leads() for w in survivors) == 1
                    and metric(registry.url, "registry_watchers") == 1
                ),
                15,
                "a new leader and one watch again",
                workers,
            )
            print(f"\nthe node's new leader released the relaunch {took:.2f} s after the kill")
            for w in survivors:
                assert all(w.saw(f"FOLLOW {e.engine_id}") for e in (first, second))
                released = w.saw("RELEASED")
                assert [r.split()[1] for r in released] == [first.engine_id, second.engine_id]
                assert all(f"tries={FAIL_FIRST + 1}" in r for r in released), released
            assert not any(w.saw("NO-HANDSHAKE") for w in workers)
            assert third.engine_id
        finally:
            for w in workers:
                w.proc.stop(grace_s=2)
