"""`workers.publication.Publication`, the one lease keeper of the torchrun endpoint and the vLLM
plugin: against a real registry process, with time that moves only when the keeper waits (a
fake clock; nothing sleeps for the cadence), so every heartbeat is one step of the script."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from registry_client.errors import EngineIdMismatch
from registry_client.models import EngineIdentity, KvSpec
from workers.publication import Publication

pytestmark = pytest.mark.api

GROUP = "lease-0"


class FakeClock:
    """The keeper's `wait`: advances fake time, runs the script's step for this beat, and
    says stop once the script is over."""

    def __init__(self, steps: dict[int, Callable[[], None]], beats: int) -> None:
        self.now = 0.0
        self.waits: list[float] = []
        self.steps = steps
        self.beats = beats

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        if len(self.waits) > self.beats:
            return True
        self.steps.get(len(self.waits), lambda: None)()
        return False


def open_engine(client: RegistryClient, launch_id: str) -> EngineIdentity:
    engine, _ = client.open_engine(GROUP, launch_id=launch_id, tp_size=1, role="prefill")
    return EngineIdentity(GROUP, engine.engine_id, engine.generation, client.url, launch_id)


def publication(url: str, identity: EngineIdentity, clock: FakeClock, **kw: object) -> Publication:
    return Publication(
        lambda: RegistryClient(url, timeout_s=5.0),
        identity,
        0,
        agent_name="agent-0",
        metadata=b"md",
        host="127.0.0.1",
        kv=KvSpec("DRAM", 0, [4096], 1, 1),
        ttl_s=30,
        fraction=0.005,
        wait=clock.wait,
        **kw,  # type: ignore[arg-type]
    )


def test_renews_every_interval_registers_again_after_404_retries_and_stops_on_409(
    registry_server: RegistryProcess,
) -> None:
    url = registry_server.url
    admin = RegistryClient(url, timeout_s=10.0)
    identity = open_engine(admin, "launch-1")
    assert (
        Publication(
            lambda: RegistryClient(url),
            identity,
            0,
            agent_name="a",
            metadata=b"m",
            host="h",
            kv=KvSpec("DRAM", 0, [1], 1, 1),
            ttl_s=30,
        ).interval_s
        == 10
    )  #  (the default cadence: ttl/3)

    def lease_lost() -> None:  # as after a registry outage longer than the lease
        admin.deregister_agent(GROUP, 0, engine_id=identity.engine_id)

    def freeze() -> None:  # the registry stops answering: the next beat fails
        os.kill(registry_server.pid, signal.SIGSTOP)

    def thaw() -> None:
        os.kill(registry_server.pid, signal.SIGCONT)

    clock = FakeClock({2: lease_lost, 3: freeze, 4: thaw}, beats=5)
    pub = publication(url, identity, clock)
    try:
        assert pub.publish()  # created
        pub.run()
    finally:
        thaw()
    # Beat 1 renewed, 2 found the lease gone and registered again, 3 failed (the registry
    # frozen past the call's deadline, which is the interval) and 4 and 5 renewed. After the
    # failure the next beat came sooner, after a full-jitter pause of registry_client.backoff.
    assert len(clock.waits) == 6
    assert clock.waits[:3] + clock.waits[4:] == [pub.interval_s] * 5
    assert 0 <= clock.waits[3] <= pub.interval_s
    assert (pub.heartbeats, pub.reregistrations, pub.failures) == (3, 1, 1)
    assert not pub.superseded.is_set()
    assert admin.get_engine(GROUP).registered_ranks == [0]
    pub.close()
    assert admin.get_engine(GROUP).registered_ranks == []  # closing deregisters

    # A newer launch supersedes the engine: the next beat gets 409 and the keeper stops.
    seen: list[EngineIdMismatch] = []
    clock = FakeClock({2: lambda: open_engine(admin, "launch-2")}, beats=10)
    pub = publication(url, identity, clock, on_superseded=seen.append)
    pub.publish()
    pub.run()
    assert len(clock.waits) == 2  # stopped at once, not at the end of the script
    assert pub.superseded.is_set()
    assert [exc.cause for exc in seen] == ["superseded"]
    pub.close()  # superseded: nothing to deregister, and no error
    admin.close()
