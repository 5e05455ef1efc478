"""A decode worker's handshake through the registry and its release on the registry's word
(workers.vllm_plugin.via_registry, .release, .metrics), against a real registry process.

vLLM's NIXL worker is a stand-in here, named so: `StandInWorker._nixl_handshake` speaks the
side channel's protocol as vLLM 0.32's does (a REQ socket from this module's `zmq_ctx`,
``(GET_META_MSG, pp, tp)`` out, ``[payload, perf_counter]`` in, per target rank) and keeps
vLLM's bookkeeping names. Its `zmq_ctx` opens a real ZMQ socket, so a handshake that dials the
side channel shows as a timeout against a closed port. The real vLLM runs in the vLLM tier.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from harness.server import RegistryProcess, free_port
from registry_client.client import RegistryClient
from registry_client.models import KvSpec
from workers.vllm_plugin import decode_side, metrics, node_follow, release, via_registry
from workers.vllm_plugin.settings import PluginSettings
from workers.vllm_plugin.stale import StaleRemoteEngine

pytestmark = pytest.mark.api
GET_META_MSG = b"get_meta_msg"


@contextlib.contextmanager
def zmq_ctx(socket_type: int, addr: str) -> Iterator[Any]:
    """What vLLM's nixl/utils.py `zmq_ctx` does: a connected socket, closed on exit."""
    ctx = zmq.Context()
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


class StandInWorker:
    """vLLM's NIXL worker's handshake and bookkeeping, as far as the plugin touches them."""

    def __init__(self, tp_rank: int = 0) -> None:
        self.tp_rank = tp_rank
        self._handshake_lock = threading.Lock()
        self._remote_agents: dict[str, dict[tuple[int, int], str]] = {}
        self._engine_by_address: dict[tuple[str, int], str] = {}
        self.offsets: list[float] = []

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
    ) -> tuple[dict[tuple[int, int], str], float]:
        ranks = [self.tp_rank] if remote_tp_size == 1 else list(range(remote_tp_size))
        agents: dict[tuple[int, int], str] = {}
        best: float | None = None
        with zmq_ctx(zmq.REQ, f"tcp://{host}:{port}") as sock:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            for rank in ranks:
                start = time.perf_counter()
                sock.send(msgpack.packb((GET_META_MSG, 0, rank)))
                payload, remote_perf = sock.recv_multipart()
                end = time.perf_counter()
                best = msgpack.unpackb(remote_perf) - (start + end) / 2
                decoded = msgpack.unpackb(payload)
                if decoded["engine_id"] != expected_engine_id:
                    raise RuntimeError("Remote NIXL agent engine ID mismatch.")
                agents[(0, rank)] = decoded["agent"]
        assert best is not None
        self.offsets.append(best)
        with self._handshake_lock:
            self._remote_agents[expected_engine_id] = agents
            self._engine_by_address[(host, port)] = expected_engine_id
        return agents, best

    def _cleanup_remote_engine(self, engine_id: str) -> None:
        with self._handshake_lock:
            self._remote_agents.pop(engine_id)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("via")
    with RegistryProcess(f"sqlite:///{Path(d) / 'r.db'}", log_path=Path(d) / "r.log") as proc:
        yield proc


def _publish(
    client: RegistryClient, group: str, tp: int, clock: float, *, blob: bool = True, ttl_s: int = 30
) -> str:
    engine, _ = client.open_engine(
        group, launch_id=uuid.uuid4().hex, tp_size=tp, role="prefill", compat={"block_size": 16}
    )
    for rank in range(tp):
        extra: dict[str, Any] = {"scheduler_clock": clock}
        if blob:
            extra["blob"] = via_registry.BLOB_FORMAT
        payload = msgpack.packb({"engine_id": engine.engine_id, "agent": f"agent-{rank}"})
        client.register_agent(
            group,
            rank,
            engine_id=engine.engine_id,
            agent_name=f"agent-{rank}",
            agent_metadata=payload,
            host="127.0.0.1",
            kv=KvSpec("DRAM", 0, [4096], 8, 512, extra=extra),
            ttl_s=ttl_s,
        )
    return engine.engine_id


def _settings(registry: RegistryProcess) -> PluginSettings:
    return PluginSettings(url=registry.url, group="decode-a")


@pytest.fixture(scope="module")
def side(registry: RegistryProcess) -> via_registry.DecodeSide:
    """The asking decode: a group of this registry (a handshake naming another is refused)."""
    with RegistryClient(registry.url) as client:
        engine, _ = client.open_engine(
            "decode-a", launch_id=uuid.uuid4().hex, tp_size=1, role="decode"
        )
    return via_registry.DecodeSide(1, 0, {"block_size": 16}, "decode-a", engine.engine_id)


def test_the_handshake_loads_every_rank_from_the_registry_without_dialing(
    registry: RegistryProcess, side: via_registry.DecodeSide
) -> None:
    closed = free_port()  # nothing listens: a dial would time out
    with RegistryClient(registry.url) as client:
        clock = via_registry.clock_reference() + 2.5  # the prefill's node 0 runs 2.5 s ahead
        engine_id = _publish(client, "prefill-a", 2, clock)
        worker = StandInWorker()
        done: list[str] = []
        assert via_registry.install(
            worker, _settings(registry), side, on_handshake=lambda eid, _plan: done.append(eid)
        )
        agents, offset = worker._nixl_handshake("127.0.0.1", closed, 2, engine_id)
        assert agents == {(0, 0): "agent-0", (0, 1): "agent-1"}
        assert abs(offset - 2.5) < 0.05, offset  # vLLM's own estimate, from the registry's clock
        assert done == [engine_id]
        # The registry's event names the asking decode group (the status page shows it).
        time.sleep(1.5)
        events = client.request("GET", "/events", params={"limit": 1000}).json()["events"]
        details = [
            e["detail"] for e in events if e["kind"] == "handshake" and e["group_id"] == "prefill-a"
        ]
        assert any("decode group 'decode-a'" in d for d in details), details
        page = html.unescape(client.request("GET", "/status").text)  # escaped as text
        assert "decode group 'decode-a' TP 1 ranks 0 planned against" in page

        # Side-channel mode really dials: the same call to the closed port times out.
        plain = StandInWorker()
        with pytest.raises(zmq.Again):
            plain._nixl_handshake("127.0.0.1", closed, 2, engine_id)


def test_stale_unready_and_unpublished_engines(
    registry: RegistryProcess, side: via_registry.DecodeSide
) -> None:
    with RegistryClient(registry.url) as client:
        old = _publish(client, "prefill-b", 1, via_registry.clock_reference())
        _publish(client, "prefill-b", 1, via_registry.clock_reference())
        worker = StandInWorker()
        via_registry.install(worker, _settings(registry), side)
        t0 = time.monotonic()
        with pytest.raises(StaleRemoteEngine, match="superseded by generation 2"):
            worker._nixl_handshake("127.0.0.1", free_port(), 1, old)
        assert time.monotonic() - t0 < 1.0
        unready, _ = client.open_engine("prefill-c", launch_id="x", tp_size=2, role="prefill")
        with pytest.raises(via_registry.RegistryHandshakeError, match="no live agent"):
            worker._nixl_handshake("127.0.0.1", free_port(), 2, unready.engine_id)
        # A prefill that published no payload (an older plugin) is dialed instead.
        legacy = _publish(client, "prefill-d", 1, 0.0, blob=False)
        sides: list[int] = []
        via_registry.install(StandInWorker(), _settings(registry), side)
        worker2 = StandInWorker()
        via_registry.install(
            worker2, _settings(registry), side, on_side_channel=lambda: sides.append(1)
        )
        with pytest.raises(zmq.Again):
            worker2._nixl_handshake("127.0.0.1", free_port(), 1, legacy)
        assert sides == [1]


def test_released_engines_go_through_vllms_bookkeeping(
    registry: RegistryProcess, side: via_registry.DecodeSide
) -> None:
    with RegistryClient(registry.url) as client:
        first = _publish(client, "prefill-e", 1, 0.0)
        lapsing = _publish(client, "prefill-f", 1, 0.0, ttl_s=5)
        worker = StandInWorker()
        released: list[tuple[str, str]] = []
        follower = release.Follower(
            _settings(registry),
            lambda eid: release.hand_to_vllm(worker, eid),
            lambda followed, kind, _why: released.append((followed.engine_id, kind)),
        )
        via_registry.install(worker, _settings(registry), side, on_handshake=follower.follow)
        worker._nixl_handshake("127.0.0.1", 1, 1, first)
        worker._nixl_handshake("127.0.0.1", 2, 1, lapsing)
        assert set(worker._engine_by_address.values()) == {first, lapsing}
        _publish(client, "prefill-e", 1, 0.0)  # relaunched
        deadline = time.monotonic() + 15
        while len(released) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        follower.close()
    assert sorted(released) == sorted([(first, "superseded"), (lapsing, "not_ready")])
    # vLLM's `_cleanup_remote_engines` releases what no address maps to any more.
    assert set(worker._remote_agents) - set(worker._engine_by_address.values()) == {first, lapsing}


def test_counters_are_summed_across_workers(tmp_path: Path) -> None:
    a, b = metrics.WorkerCounters(str(tmp_path)), metrics.WorkerCounters(str(tmp_path))
    b.path = tmp_path / "worker-other.json"
    a.handshake("registry", 1)
    b.handshake("side_channel", 2)
    a.released("superseded")
    a.freed(0)
    total = metrics.totals(tmp_path)
    assert total.handshakes == {"registry": 1, "side_channel": 1}
    assert total.released == {"superseded": 1}
    assert (total.freed, total.held) == (1, 2)
    names = {m.name: m for m in metrics.Collector(tmp_path).collect()}
    assert names["engine_registry_remote_engines"].samples[0].value == 2


def _released(worker: StandInWorker, engine_id: str, timeout_s: float) -> bool:
    """vLLM's bookkeeping no longer maps an address to ``engine_id`` (the release happened)."""
    deadline = time.monotonic() + timeout_s
    while engine_id in worker._engine_by_address.values():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_runtime_dir_another_user_took_costs_the_sharing_never_a_handshake(
    registry: RegistryProcess,
    side: via_registry.DecodeSide,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A container: no XDG_RUNTIME_DIR, no /run/user/<uid>; the shared <tmp> is this test's.
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(node_follow, "USER_RUN", tmp_path / "no-run-user")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    taken = tmp_path / f"engine-registry-{os.getuid()}"
    taken.mkdir(mode=0o700)  # made first by another local user: theirs (as root), else open
    if os.getuid() == 0:
        os.chown(taken, 65534, 65534)
    else:
        taken.chmod(0o777)
    with pytest.raises(node_follow.NodeFollowError, match="not this user's private directory"):
        node_follow.runtime_dir()
    worker = StandInWorker()
    assert decode_side.attach_decode_side(worker, _settings(registry), side)
    with RegistryClient(registry.url) as client, caplog.at_level(logging.INFO):
        first = _publish(client, "prefill-g", 1, 0.0)
        other = _publish(client, "prefill-h", 1, 0.0)
        worker._nixl_handshake("127.0.0.1", 1, 1, first)  # neither raises
        worker._nixl_handshake("127.0.0.1", 2, 1, other)
        _publish(client, "prefill-g", 1, 0.0)  # relaunched: released on the worker's own watch
        try:
            assert _released(worker, first, 15.0), worker._engine_by_address
        finally:
            worker._engine_registry_follower.close()
    feed = worker._engine_registry_follower.feed
    assert feed is not None
    assert feed.role == "alone"
    said = [r for r in caplog.records if "not this user's private directory" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "holds its own registry watch" in said[0].getMessage()


def test_a_follower_that_fails_never_fails_the_handshake(
    registry: RegistryProcess,
    side: via_registry.DecodeSide,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(*_args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(release.Follower, "follow", broken)
    worker = StandInWorker()
    assert decode_side.attach_decode_side(worker, _settings(registry), side)
    with RegistryClient(registry.url) as client, caplog.at_level(logging.INFO):
        first = _publish(client, "prefill-i", 1, 0.0)
        second = _publish(client, "prefill-j", 1, 0.0)
        worker._nixl_handshake("127.0.0.1", 1, 1, first)
        worker._nixl_handshake("127.0.0.1", 2, 1, second)
    assert set(worker._engine_by_address.values()) == {first, second}
    said = [r for r in caplog.records if "cannot follow remote engines" in r.getMessage()]
    assert len(said) == 1
