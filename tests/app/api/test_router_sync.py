"""`engine-registry router-sync` feeding a real vllm-router (0.1.17, PD mode, no prefill or
decode URL on its command line) from a real registry. The instances behind the router are
stand-ins (tests/support/pd_stand_in.py: HTTP servers answering as vLLM's OpenAI server
does in PD); real vLLM instances behind the same router run in the vLLM tier."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from harness.serving_fleet import one_rank_agent
from tests.app.api.conftest import tokened_registry
from tests.app.conftest import READER, WORKER
from tests.support.pd_stand_in import StandIn, StandIns
from workers.tools.procs import log_tail
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess

pytestmark = [pytest.mark.api, pytest.mark.timeout(240)]
COMPAT = {"model": "tiny", "block_size": 16, "dtype": "bfloat16"}
EXPIRY_S = 5.0  # vllm-router forgets an instance not announced for this long


def waited(
    check: Callable[[], bool], within_s: float, what: str, logs: Callable[[], str] = str
) -> float:
    """Seconds until ``check()`` held; fails naming ``what`` past ``within_s``, with
    ``logs()`` (what the processes said)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within_s, f"{what}: not within {within_s} s\n{logs()}"
        time.sleep(0.2)
    return time.monotonic() - t0


def wait_for(check: Callable[[], bool], within_s: float, what: str) -> float:
    """`waited` without logs (the other router-sync tests import it)."""
    return waited(check, within_s, what)


class Fleet:
    """Groups in the registry, each with one rank, published at a stand-in's URL."""

    def __init__(self, registry: RegistryProcess, stand_ins: StandIns) -> None:
        self.http = httpx.Client(
            base_url=registry.url, headers={"Authorization": f"Bearer {WORKER}"}, timeout=10
        )
        self.stand_ins = stand_ins

    def launch(self, gid: str, kind: str, *, ttl_s: int = 600, **compat: Any) -> StandIn:
        body = {
            "launch_id": uuid.uuid4().hex,
            "tp_size": 1,
            "role": kind,
            "compat": {**COMPAT, **compat},
        }
        engine = self.http.put(f"/tp-groups/{gid}/engine", json=body).json()
        instance = self.stand_ins.add(f"{gid}-g{engine['generation']}", kind, engine["engine_id"])
        self.register(gid, engine["engine_id"], ttl_s)
        published = self.http.put(
            f"/tp-groups/{gid}/engine/serving",
            json={"engine_id": engine["engine_id"], "url": instance.url, "model": "tiny"},
        )
        assert published.status_code == 200, published.text
        return instance

    def watchers(self) -> float:
        """Watch streams open on the registry (its ``registry_watchers`` gauge)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("registry_watchers "):
                return float(line.split()[1])
        return 0.0

    def register(self, gid: str, engine_id: str, ttl_s: int) -> None:
        agent = one_rank_agent(engine_id, f"{engine_id}-0", ttl_s)
        answer = self.http.put(f"/tp-groups/{gid}/engine/agents/0", json=agent)
        assert answer.status_code in (200, 201), answer.text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-sync")


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[RegistryProcess]:
    with tokened_registry(workdir) as proc:
        yield proc


def complete(router: VllmRouterProcess) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)


def test_a_vllm_router_fed_only_by_router_sync_follows_the_registry(
    workdir: Path, registry: RegistryProcess
) -> None:
    stand_ins = StandIns()
    fleet = Fleet(registry, stand_ins)
    router = VllmRouterProcess(workdir).start()
    sync = RouterSyncProcess(workdir, registry.url, [router.discovery], token=READER)

    def logs() -> str:
        return (
            f"router-sync's log:\n{sync.log_text()[-4000:]}\n"
            f"the registry's last lines:\n{log_tail(registry.log_path, 4000)}"
        )

    def wait_for(check: Callable[[], bool], within_s: float, what: str) -> float:
        return waited(check, within_s, what, logs)

    try:
        p1 = fleet.launch("prefill-a", "prefill")
        d1 = fleet.launch("decode-a", "decode")
        bad = fleet.launch("prefill-b", "prefill", block_size=32)  # never to be offered
        sync.start()

        # PD through the router: prefill first (max_tokens 1, do_remote_decode), then decode
        # with what prefill answered.
        wait_for(lambda: complete(router).status_code == 200, 15, "router serves PD")
        answer = complete(router)
        assert answer.json()["choices"][0]["text"] == f"{d1.name} decoded from {p1.engine_id}"
        assert p1.completions[-1]["max_tokens"] == 1
        assert p1.completions[-1]["kv_transfer_params"]["do_remote_decode"] is True
        assert "not offering prefill-b: incompatible: block_size 32 vs 16" in sync.log_text()
        assert not bad.completions
        assert f"HTTP:127.0.0.1:{bad.port}" not in router.log_text()

        # The prefill group is relaunched on another port: the router moves to it, and once
        # its expiry has passed it never again sends to the superseded one.
        p2 = fleet.launch("prefill-a", "prefill")
        superseded_at = time.monotonic()

        def moved_on() -> bool:
            return complete(router).status_code == 200 and p2.since(superseded_at) > 0

        moved = wait_for(moved_on, 15, "router sends to the relaunched prefill")
        print(f"router used the relaunched prefill after {moved:.1f} s")
        # router-sync told the router of p2, so it no longer names p1: past the router's
        # expiry from then (not from the relaunch: a round under load may end after it), p1
        # is forgotten.
        time.sleep(EXPIRY_S + 1)
        cut = time.monotonic()
        for _ in range(6):
            assert complete(router).status_code == 200
        assert p1.since(cut) == 0
        assert p2.since(cut) == 6
        assert "withdraw prefill prefill-a (generation 1" in sync.log_text()

        # A router restarted on the same addresses has the instances again within a round.
        router.stop()
        router.start()
        wait_for(lambda: complete(router).status_code == 200, 10, "restarted router serves")

        # The registry goes away: the router keeps being told the last list, past its expiry.
        registry.stop()
        time.sleep(EXPIRY_S + 2)
        assert complete(router).status_code == 200
        registry.start()

        # A decode instance whose rank stops renewing its lease: once the lease lapses the
        # router is told no more, and forgets it after its expiry.
        # router-sync's watch comes back on its jittered back-off (the watch's, capped at 8 s),
        # which grew while the registry was away. The decode's lease lives 5 s: launched before
        # the watch is back, it could lapse before router-sync hears of it (about 1 run in
        # 10), and then it is rightly never offered
        # (tests/registry_client/router_sync/test_registry_restart.py). So the watch first
        # (at most its cap, 8 s, after the registry is up, or at its 15 s deadline); its log
        # says when ("watch: back on ...").
        wait_for(lambda: fleet.watchers() >= 1, 15, "router-sync's watch back")
        d2 = fleet.launch("decode-a", "decode", ttl_s=5)
        wait_for(lambda: "offer decode decode-a (generation 2" in sync.log_text(), 25, "d2")
        gone = wait_for(
            lambda: complete(router).status_code != 200,
            5 + EXPIRY_S + 10,
            "the router stops using the decode whose lease lapsed",
        )
        print(f"decode left the router {gone:.1f} s after its last renewal (ttl 5 s)")
        forgotten = time.monotonic()  # within the deadline above; and it stays forgotten
        assert all(complete(router).status_code != 200 for _ in range(3))
        assert d2.since(forgotten) == 0
        assert "withdraw decode decode-a (generation 2" in sync.log_text()
        assert "not ready" in sync.log_text()
        # With no decode left, no prefill is offered: the incompatible one least of all.
        assert f"HTTP:127.0.0.1:{bad.port}" not in router.log_text()
        assert "withdraw prefill prefill-a (generation 2" in sync.log_text()
        assert "no decode instance to pair with" in sync.log_text()
    finally:
        sync.stop()
        router.stop()
        stand_ins.close()
        fleet.http.close()
