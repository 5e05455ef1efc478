"""`workers.keepalive`: the lease keeper renews over the registry's keep-alive stream, and over
REST when the registry refuses the stream (streams off: 404) or the stream breaks, then opens
it again. Real registry processes; the keeper's cadence on a fake clock (`wait`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.fleet_stream import NodeStream
from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from registry_client.models import AgentItem, EngineIdentity, KvSpec
from workers.keepalive import stream_url
from workers.publication import BatchPublication

pytestmark = [pytest.mark.api, pytest.mark.timeout(60)]


class Script:
    """The keeper's `wait`: no real sleep for the cadence; step `n` runs before beat `n`."""

    def __init__(self, beats: int, steps: dict[int, Callable[[], None]] | None = None) -> None:
        self.beats = beats
        self.steps = steps or {}
        self.waits = 0

    def wait(self, seconds: float) -> bool:
        self.waits += 1
        if self.waits > self.beats:
            return True
        self.steps.get(self.waits, lambda: None)()
        return False


def batch(url: str, group: str, script: Script) -> BatchPublication:
    admin = RegistryClient(url, timeout_s=10.0)
    engine, _ = admin.open_engine(group, launch_id="l-1", tp_size=2, role="prefill")
    admin.close()
    identity = EngineIdentity(group, engine.engine_id, engine.generation, url, "l-1")
    agents = [
        AgentItem(r, engine.engine_id, f"a{r}", b"md", "127.0.0.1", KvSpec("DRAM", 0, [1], 1, 1))
        for r in range(2)
    ]
    return BatchPublication(
        lambda: RegistryClient(url, timeout_s=5.0),
        identity,
        agents,
        ttl_s=30,
        fraction=0.1,
        wait=script.wait,
    )


def test_the_keeper_renews_over_the_stream_and_stops_when_superseded(tmp_path: Path) -> None:
    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}") as server:
        pub = batch(server.url, "ka-stream", Script(beats=10))
        try:
            assert pub.publish()
            pub.run()
            assert pub.stream is not None
            assert (pub.heartbeats, pub.stream.renewals, pub.stream.connects) == (10, 10, 1)
            assert pub.stream.ws is not None
            assert pub.stream.ws.ping_interval is None  # renewals show it alive: no pings
            admin = RegistryClient(server.url)
            admin.open_engine("ka-stream", launch_id="l-2", tp_size=2, role="prefill")
            admin.close()
            assert not pub.beat()  # the 409 came over the stream: the keeper stops
            assert pub.superseded.is_set()
            assert pub.stream.renewals == 10
        finally:
            pub.close()


def test_the_keeper_renews_over_rest_when_the_registry_refuses_the_stream(
    tmp_path: Path,
) -> None:
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'r.db'}", env={"REGISTRY_KEEPALIVE_MAX": "0"}
    ) as server:
        pub = batch(server.url, "ka-rest", Script(beats=5))
        try:
            pub.publish()
            pub.run()
            assert pub.stream is not None
            assert pub.stream.refused == 404
            assert (pub.heartbeats, pub.failures, pub.reregistrations) == (5, 0, 0)
            assert (pub.stream.renewals, pub.stream.connects) == (0, 0)
            assert pub.stream.next_try - time.monotonic() > 60  # not asked again each beat
        finally:
            pub.close()


def test_a_broken_stream_falls_back_to_rest_then_opens_again(tmp_path: Path) -> None:
    env = {"REGISTRY_KEEPALIVE_IDLE_S": "1"}  # the registry closes a quiet stream after 1 s

    def quiet() -> None:
        time.sleep(1.5)

    def until_retry() -> None:
        assert pub.stream is not None
        time.sleep(max(0.0, pub.stream.next_try - time.monotonic()) + 0.05)

    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", env=env) as server:
        pub = batch(server.url, "ka-broken", Script(beats=3, steps={2: quiet, 3: until_retry}))
        try:
            pub.publish()
            pub.run()
            assert pub.stream is not None
            # beat 1 on the stream; beat 2 finds it closed and renews over REST; beat 3
            # opens a new stream after the back-off's pause.
            assert (pub.heartbeats, pub.failures) == (3, 0)
            assert (pub.stream.renewals, pub.stream.connects) == (2, 2)
        finally:
            pub.close()


def test_the_fleet_benchmarks_stream_client_opens_its_stream_as_the_keeper(
    tmp_path: Path,
) -> None:
    """``bench/fleet_stream.py`` stands in for the keeper in the fleet's figures, so it sends
    what the keeper sends: no pings of its own (websockets' default, every 20 s, was 625
    ping-pong exchanges a second at 12,500 nodes, counted as the registry's work)."""

    async def opened(url: str) -> tuple[int | None, float | None, bool]:
        node = NodeStream(stream_url(url), "ka-bench", "no-such-engine", [0])
        try:
            status = await node.renew(5.0)
            assert node.ws is not None
            return status, node.ws.ping_interval, node.ws.keepalive_task is None
        finally:
            await node.close()

    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}") as server:
        status, interval, no_pinger = asyncio.run(opened(server.url))
    assert status == 404  # answered over the stream: the group has no engine
    assert interval is None
    assert no_pinger
