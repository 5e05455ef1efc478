"""Prefill with data parallelism 2 over two nodes + decode, NixlConnector on CPU, real vLLM.

vLLM 0.32's own multi-node DP start (docs/vllm-plugin.md "Data parallel"): node 0 runs the API
server, the DP coordinator and DP rank 0; node 1 is `--headless --data-parallel-start-rank 1`
and runs DP rank 1; each rank TP 1. The registry holds one group per DP rank
(`prefill-dp-dp{r}`), each its own engine; vLLM's ids are the registry's plus `_dp{r}`. A PD
request goes to one rank by vLLM's `X-data-parallel-rank` header; the answer's
`kv_transfer_params` name that rank's engine and side channel, and decode loads it through the
registry. One launch serves the module; the tests run in file order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from registry_client.client import RegistryClient
from registry_client.errors import NotFound
from registry_client.models import Engine
from tests.workers.vllm_plugin.conftest import DP_RANKS, FIGURES
from tests.workers.vllm_plugin.decode_checks import (
    connector_ids,
    handshake_event,
    handshake_seconds,
    logged,
    metric,
)
from tests.workers.vllm_plugin.pd_shared import PROMPT, START_S
from tests.workers.vllm_plugin.routing import Routing, serving
from workers.tools.vllm_launch import Instance, Registry
from workers.tools.vllm_pd import DP_RANK_HEADER, nixl_transfers, pd_complete
from workers.vllm_plugin.resolve import resolve_remote_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
GROUP = "prefill-dp"
RANKS = (0, 1)
# What a relaunched DP rank's engine core logs (at DEBUG) while it waits for rank 0's front-end.
WAITS_FOR_FRONT_END = "Waiting for init message from front-end."


def client(registry: Registry, role: str = "reader") -> RegistryClient:
    return RegistryClient(registry.url, token=getattr(registry.tokens, role))


@dataclass
class Dp:
    registry: Registry
    model: Path
    prefill: Instance
    decode: Instance
    engines: dict[int, Engine] = field(default_factory=dict)
    own: dict[int, str] = field(default_factory=dict)  # each rank's own greedy text
    reads: dict[int, float] = field(default_factory=lambda: dict.fromkeys(RANKS, 0.0))
    workdir: Path = Path()
    routing: Routing | None = None

    def body(self) -> dict[str, object]:
        return {"model": str(self.model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0}

    def pd(self, rank: int) -> tuple[httpx.Response, dict[str, object]]:
        """A PD request handed to DP rank `rank`; decode's NIXL reads it made, counted."""
        before = nixl_transfers(self.decode.url)
        answer, params = pd_complete(
            self.prefill.url,
            self.decode.url,
            self.body(),
            dp_rank=rank,
            decode_logs=self.decode.log_text,
        )
        self.reads[rank] += nixl_transfers(self.decode.url) - before
        return answer, params

    def served(self, rank: int) -> float:
        """Requests DP rank `rank`'s engine finished (vLLM's per-engine series)."""
        text = httpx.get(f"{self.prefill.url}/metrics", timeout=60.0).text
        want = f'vllm:request_success_total{{engine="{rank}"'
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want)
        )

    def summary(self) -> None:
        with httpx.Client(base_url=self.registry.url, headers=self.registry.headers()) as http:
            for rank in RANKS:
                engine = http.get(f"/tp-groups/{GROUP}-dp{rank}/engine").json()
                DP_RANKS[f"DP rank {rank} ({GROUP}-dp{rank})"] = (
                    f"vLLM engine id {engine['engine_id']}_dp{rank}, generation "
                    f"{engine['generation']}, ready {engine['ready']}, requests served "
                    f"{self.served(rank):.0f}, NIXL reads {self.reads[rank]:.0f}"
                )


@pytest.fixture(scope="module")
def dp(vllm_workdir: Path, tiny_model: Path, registry: Registry) -> Iterator[Dp]:
    worker = registry.tokens.worker
    prefill = Instance(
        "prefill-dp",
        tiny_model,
        vllm_workdir,
        nodes=2,
        dp=2,
        registry_url=registry.url,
        registry_token=worker,
        group=GROUP,
        role="prefill",
        extra_env={"ENGINE_REGISTRY_TTL_S": "10"},
    )
    decode = Instance(
        "decode-dp",
        tiny_model,
        vllm_workdir,
        registry_url=registry.url,
        registry_token=worker,
        group="decode-0",
        role="decode",
    )
    state = Dp(registry, tiny_model, prefill, decode, workdir=vllm_workdir)
    try:
        FIGURES["prefill DP 2 over two nodes: healthy after"] = prefill.start().wait_healthy(
            START_S
        )
        FIGURES["decode beside DP prefill: healthy after"] = decode.start().wait_healthy(START_S)
        yield state
    finally:
        with contextlib.suppress(Exception):  # what the module saw, even when a test failed
            state.summary()
        if state.routing is not None:
            state.routing.stop()
        prefill.stop()
        decode.stop()


def test_each_dp_rank_is_a_registry_group_with_its_own_engine(dp: Dp) -> None:
    with client(dp.registry) as reader:
        for rank in RANKS:
            engine = dp.engines[rank] = reader.get_engine(f"{GROUP}-dp{rank}")
            assert engine.ready, engine
            assert engine.generation == 1
            assert engine.registered_ranks == [0]
            assert engine.role == "prefill"
        assert dp.engines[0].engine_id != dp.engines[1].engine_id
        with pytest.raises(NotFound):
            reader.get_engine(GROUP)  # no group without the rank: the ranks never collide
    # Node r runs DP rank r only: its worker and its scheduler made their connectors with the
    # registry's id plus vLLM's `_dp{r}`, and nothing else.
    for rank, text in enumerate(dp.prefill.logs()):
        vllm_id = f"{dp.engines[rank].engine_id}_dp{rank}"
        assert f"of group '{GROUP}-dp{rank}' uses the registry's engine_id {vllm_id}" in text
        assert f"scheduler of group '{GROUP}-dp{rank}' uses the registry's engine_id" in text
        assert connector_ids(dp.prefill)[rank] == {vllm_id}, dp.prefill.tails()


def test_decode_finds_each_dp_rank_through_the_registry(dp: Dp) -> None:
    for rank in RANKS:
        own = httpx.post(
            f"{dp.prefill.url}/v1/completions",
            json=dp.body(),
            headers={DP_RANK_HEADER: str(rank)},
            timeout=120.0,
        )
        assert own.status_code == 200, own.text[:500]
        dp.own[rank] = own.json()["choices"][0]["text"]
    with client(dp.registry) as reader, client(dp.registry, "worker") as worker:
        for rank in RANKS:
            engine = dp.engines[rank]
            vllm_id = f"{engine.engine_id}_dp{rank}"
            answer, params = dp.pd(rank)
            assert answer.status_code == 200, (answer.text[:1000], dp.decode.tails())
            assert answer.json()["choices"][0]["text"] == dp.own[rank]
            assert params["remote_engine_id"] == vllm_id
            assert params["remote_port"] == dp.prefill.side_channel_port + rank
            assert dp.reads[rank] >= 1, dp.decode.tails()
            path, took, _ = handshake_seconds(dp.decode, vllm_id)
            assert path == "registry", dp.decode.tails()
            FIGURES[f"decode handshake with DP rank {rank} through the registry"] = took
            event = handshake_event(reader, f"{GROUP}-dp{rank}", engine.engine_id)
            assert "decode group 'decode-0'" in event["detail"], event
            remote = resolve_remote_engine(worker, params)
            assert remote.engine.group_id == f"{GROUP}-dp{rank}"
            assert remote.dp_rank == rank
            port = dp.prefill.side_channel_port + rank
            assert remote.side_channels() == {0: ("127.0.0.1", port)}
    assert metric(dp.decode.url, "engine_registry_remote_engines") == 2
    for rank in RANKS:
        assert dp.served(rank) >= 2  # its own request and the PD one's prefill


def test_routers_see_each_dp_rank(dp: Dp) -> None:
    # Node 0's API server serves both ranks: it published each rank's group at its URL with
    # its `dp_rank` and that rank's side channel (vLLM's base port + the DP rank).
    with client(dp.registry) as reader:
        for rank in RANKS:
            published = serving(reader, f"{GROUP}-dp{rank}", dp.prefill.url).raw["serving"]
            assert published["dp_rank"] == rank, published
            assert published["bootstrap"] == f"127.0.0.1:{dp.prefill.side_channel_port + rank}"
        serving(reader, "decode-0", dp.decode.url)
    routing = dp.routing = Routing.start(dp.workdir, dp.registry.url, dp.registry.tokens.reader)
    for rank in RANKS:
        routing.said(f"offer prefill {GROUP}-dp{rank} (generation 1", 30)
    via, FIGURES["PD through vllm-router to a DP prefill: first answer after"] = routing.answer(
        dp.body(), 60
    )
    assert via.json()["choices"][0]["text"] == dp.own[0]
    routing.said(f"Add Prefill [HTTP:127.0.0.1:{dp.prefill.port}", 5)


def test_a_dp_rank_killed_alone_is_released_alone_and_rank_0_keeps_serving(dp: Dp) -> None:
    gone = f"{dp.engines[1].engine_id}_dp1"
    kept = f"{dp.engines[0].engine_id}_dp0"
    released_before = metric(
        dp.decode.url, "engine_registry_remote_engines_released_total", 'cause="not_ready"'
    )
    since = len(dp.decode.log_text())
    t0 = time.monotonic()
    dp.prefill.kill_node(1)
    during = 0
    # Rank 0 serves PD throughout: until decode released rank 1's engine (its 10 s lease
    # lapsed), and while node 1 starts again below.
    while f"releasing remote engine {gone}" not in dp.decode.log_text()[since:]:
        assert time.monotonic() - t0 < 60, dp.decode.tails()
        answer, _ = dp.pd(0)
        assert answer.status_code == 200, (answer.text[:1000], dp.decode.tails())
        assert answer.json()["choices"][0]["text"] == dp.own[0]
        during += 1
        time.sleep(1.0)
    FIGURES["decode released the killed DP rank 1's engine after"] = time.monotonic() - t0
    answer, _ = dp.pd(0)  # vLLM frees a released engine's NIXL state at its next engine step
    assert answer.status_code == 200, (answer.text[:1000], dp.decode.tails())
    during += 1
    logged(dp.decode, f"freed the NIXL state of remote engine {gone}", 30, since)
    releases = [
        line
        for line in dp.decode.log_text()[since:].splitlines()
        if "releasing remote engine" in line
    ]
    assert len(releases) == 1, releases
    assert gone in releases[0], releases
    assert kept not in "".join(releases)
    released = metric(
        dp.decode.url, "engine_registry_remote_engines_released_total", 'cause="not_ready"'
    )
    assert released == released_before + 1
    assert metric(dp.decode.url, "engine_registry_remote_engines") == 1
    with client(dp.registry) as reader:
        assert reader.get_engine(f"{GROUP}-dp0").generation == 1
        assert reader.get_engine(f"{GROUP}-dp0").ready
        assert not reader.get_engine(f"{GROUP}-dp1").ready

        # Node 1 started again: vLLM 0.32 lets a DP rank join only while rank 0's front-end
        # starts. Its engine core says HELLO to rank 0's handshake socket, closed since that
        # start, and waits (5 minutes, then "Did not receive response from front-end"),
        # before it makes a worker: the plugin never runs, no new generation is opened.
        node1 = dp.prefill.restart_node(1, 1, {"VLLM_LOGGING_LEVEL": "DEBUG"})
        t1 = time.monotonic()
        while WAITS_FOR_FRONT_END not in node1.text():
            assert node1.alive(), node1.text()[-3000:]
            assert time.monotonic() - t1 < 240, node1.text()[-3000:]
            answer, _ = dp.pd(0)
            assert answer.status_code == 200, (answer.text[:1000], dp.decode.tails())
            during += 1
            time.sleep(1.0)
        FIGURES["relaunched DP rank 1 waiting on rank 0's front-end after"] = time.monotonic() - t1
        assert "uses the registry's engine_id" not in node1.text()
        assert reader.get_engine(f"{GROUP}-dp1").generation == 1
        assert reader.get_engine(f"{GROUP}-dp0").generation == 1
    FIGURES["PD requests to DP rank 0 while rank 1 was down (all 200)"] = float(during)
    dp.prefill.kill_node(1)
