"""Prefill TP 2 over two headless nodes + decode, NixlConnector on CPU, real vLLM.

vLLM's own engine_id broadcast is switched off on the prefill nodes (nofix/ beside this
file, "a vLLM before its fix"). One decode instance (TP 1, plugin active) serves the whole
module; prefill instances come and go. The tests run in file order and share `Shared`. The
registry runs with tokens, as in production: the plugin holds a worker token, the tests read
with a reader one. Every PD request has a deadline (`workers.tools.vllm_pd`): past it, the
failure shows decode's log.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from registry_client.errors import EngineSuperseded
from tests.workers.vllm_plugin.conftest import FIGURES, REQUESTS
from tests.workers.vllm_plugin.cpu_path import report_the_cpu_path
from tests.workers.vllm_plugin.decode_checks import (
    connector_ids,
    handshake_event,
    handshake_seconds,
    kv_request,
    logged,
    metric,
)
from tests.workers.vllm_plugin.pd_shared import NOFIX, START_S, Shared
from tests.workers.vllm_plugin.registry_requests import keepalive_renewals, report_and_check
from tests.workers.vllm_plugin.routing import serving, stale_request_fails_at_once
from workers.tools.vllm_launch import Instance, Registry, free_port
from workers.tools.vllm_pd import complete, nixl_transfers, pd_complete
from workers.vllm_plugin.kv_watch import MARK as KV_WATCH_MARK
from workers.vllm_plugin.resolve import resolve_remote_engine, split_dp_suffix

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def shared(vllm_workdir: Path, tiny_model: Path, registry: Registry) -> Iterator[Shared]:
    state = Shared(vllm_workdir, tiny_model, registry)
    try:
        yield state
    finally:
        if state.prefill is not None:
            state.prefill.stop()
        if state.decode_process is not None:
            state.decode_process.stop()
        if state.routing_process is not None:
            state.routing_process.stop()


def test_misconfigured_launches_refuse_to_start_on_every_rank_naming_the_cause(
    vllm_workdir: Path, tiny_model: Path, registry: Registry, other_registry: Registry
) -> None:
    # First in the module, before the shared decode instance takes its core. Three launches
    # at once (they fail before serving): node 1 of the first names another group, node 1 of
    # the second talks to another registry (with a token that one accepts), the third holds a
    # token the registry does not know.
    worker = registry.tokens.worker
    wrong_group = Instance(
        "wrong-group",
        tiny_model,
        vllm_workdir,
        tp=2,
        nodes=2,
        registry_url=registry.url,
        registry_token=worker,
        group="mixed-a",
        role="prefill",
        extra_env=NOFIX,
        node_env=[{}, {"ENGINE_REGISTRY_GROUP": "mixed-b"}],
    )
    wrong_registry = Instance(
        "wrong-registry",
        tiny_model,
        vllm_workdir,
        tp=2,
        nodes=2,
        registry_url=registry.url,
        registry_token=worker,
        group="mixed-c",
        role="prefill",
        extra_env=NOFIX,
        node_env=[
            {},
            {
                "ENGINE_REGISTRY_URL": other_registry.url,
                "ENGINE_REGISTRY_TOKEN": other_registry.tokens.worker,
            },
        ],
    )
    wrong_token = Instance(
        "wrong-token",
        tiny_model,
        vllm_workdir,
        registry_url=registry.url,
        registry_token="worker-not-a-token-of-this-registry",
        group="mixed-e",
        role="prefill",
    )
    t0 = time.monotonic()
    try:
        wrong_group.start()
        wrong_registry.start()
        wrong_token.start()
        codes = {"wrong-token": wrong_token.wait_exit(START_S)}
        FIGURES["launch with a wrong token refused after"] = time.monotonic() - t0
        codes["wrong-group"] = wrong_group.wait_exit(START_S)
        codes["wrong-registry"] = wrong_registry.wait_exit(START_S)
        FIGURES["misconfigured launches refused after"] = time.monotonic() - t0
        for name, (node0, *headless) in codes.items():
            # The instance (node 0's API server) fails; a headless node stops once its worker
            # exits (vLLM's headless launcher exits 0 then, so only its stopping is asserted).
            assert node0 is not None, (name, codes[name])
            assert node0 != 0, (name, codes[name])
            assert all(code is not None for code in headless), (name, codes[name])
        for instance, cause in (
            (wrong_group, "different_group"),
            (wrong_registry, "different_registry"),
            (wrong_token, "unauthorized"),
        ):
            for node, text in enumerate(instance.logs()):
                assert "refuses to start" in text, (instance.name, node, text[-3000:])
                assert cause in text, (instance.name, node, text[-3000:])
        # The cause names the fix (which variable, which role); the plugin refused in the
        # launch's first process, before vLLM started an engine core or a worker.
        assert "ENGINE_REGISTRY_TOKEN" in wrong_token.logs()[0]
        assert "401 unauthorized" in wrong_token.logs()[0]
        assert "worker role" in wrong_token.logs()[0]
        assert "(EngineCore" not in wrong_token.logs()[0], wrong_token.tails()
        with httpx.Client(base_url=registry.url, headers=registry.headers(), timeout=5.0) as http:
            for group in ("mixed-a", "mixed-c"):
                engine = http.get(f"/tp-groups/{group}/engine").json()
                assert engine["registered_ranks"] == [], engine  # nothing was published
            # The refused token opened nothing; the reader token is needed to even look.
            assert http.get("/tp-groups/mixed-e/engine").status_code == 404
            assert httpx.get(f"{registry.url}/tp-groups").status_code == 401
    finally:
        wrong_group.stop()
        wrong_registry.stop()
        wrong_token.stop()


def _start_prefill(shared: Shared, name: str, *, plugin: bool) -> Instance:
    """A new prefill, then a fresh decode. (Before the plugin set NIXL's progress thread to
    wait for events, an idle decode worker's thread spun at ~95% of its core and a prefill
    node pinned there starved past a 300 s start; the relaunch test now keeps decode up.)"""
    for running in (shared.decode_process, shared.prefill):
        if running is not None:
            running.stop()
    shared.decode_process = shared.prefill = None
    started = time.time()
    shared.prefill = shared.prefill_instance(name, plugin=plugin).start()
    FIGURES[f"{name}: healthy after"] = shared.prefill.wait_healthy(START_S)
    shared.launches["prefill-0"] = (started, time.time(), 2)
    started = time.time()
    # Before the fix, decode leaves the handshake to vLLM, so that vLLM's own error shows (with
    # its check on, the plugin refuses the unknown engine first: test_stale_engine.py).
    env = {"ENGINE_REGISTRY_CHECK_REMOTE": "false", "ENGINE_REGISTRY_HANDSHAKE": "side-channel"}
    shared.decode_process = shared.decode_instance(**({} if plugin else env)).start()
    FIGURES[f"decode with {name}: healthy after"] = shared.decode.wait_healthy(START_S)
    shared.launches["decode-0"] = (started, time.time(), 1)
    return shared.prefill


def test_before_the_fix_without_registry_the_handshake_fails(shared: Shared) -> None:
    prefill = _start_prefill(shared, "prefill-nofix", plugin=False)
    node0, node1 = connector_ids(prefill)
    assert node0, prefill.tails()
    assert node1, prefill.tails()
    assert not node0 & node1, (node0, node1)  # each node made up its own engine_id
    answer, params = shared.pd(prefill)
    assert params.get("remote_engine_id") in node0
    assert answer.status_code != 200, answer.text[:500]
    deadline = time.monotonic() + 30
    while "engine ID mismatch" not in shared.decode.logs()[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "Remote NIXL agent engine ID mismatch" in shared.decode.logs()[0]
    assert nixl_transfers(shared.decode.url) == 0


def test_with_the_plugin_prefill_to_decode_works(shared: Shared) -> None:
    prefill = _start_prefill(shared, "prefill-registry", plugin=True)
    with shared.client() as client:
        engine = client.get_engine("prefill-0")
        assert engine.ready
        assert engine.registered_ranks == [0, 1]
        assert engine.generation == 1
        assert engine.role == "prefill"
        assert engine.compat["block_size"]

        # Every rank (both nodes) logged the registry's engine_id, and vLLM made its
        # connectors (workers and scheduler) with it and nothing else.
        for text in prefill.logs():
            assert f"uses the registry's engine_id {engine.engine_id}" in text
        assert connector_ids(prefill) == [{engine.engine_id}, {engine.engine_id}]
        assert "[nofix]" in prefill.logs()[1]  # vLLM's own broadcast really was off

        before = nixl_transfers(shared.decode.url)
        own = complete(prefill.url, shared.body())
        assert own.status_code == 200, own.text[:500]
        # The first PD request names a side-channel port nothing listens on: decode loads the
        # prefill's ranks from the registry, so it never notices (side-channel mode fails
        # the same request: test_relaunched_prefill_gets_a_new_generation).
        t0 = time.monotonic()
        answer, params = pd_complete(
            prefill.url,
            shared.decode.url,
            shared.body(),
            decode_logs=shared.decode.log_text,
            side_channel_port=free_port(),
        )
        FIGURES["PD request (plugin), first"] = time.monotonic() - t0
        assert answer.status_code == 200, (answer.text[:1000], shared.decode.tails())
        assert answer.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        assert nixl_transfers(shared.decode.url) > before
        path, took, offset = handshake_seconds(shared.decode, engine.engine_id)
        assert path == "registry", shared.decode.tails()
        FIGURES["decode handshake through the registry"] = took
        assert offset is not None
        assert abs(offset) < 0.05, offset  # one host: one clock
        event = handshake_event(client, "prefill-0", engine.engine_id)
        assert "decode group 'decode-0'" in event["detail"], event
        assert metric(shared.decode.url, "engine_registry_handshakes_total", 'path="registry"')
        t0 = time.monotonic()
        again, params = shared.pd(prefill)  # the real side-channel port this time
        FIGURES["PD request (plugin), warm"] = time.monotonic() - t0
        assert again.status_code == 200, (again.text[:1000], shared.decode.tails())
        # The plugin's KV-pull watch read real vLLM's bookkeeping: the first pull waited on
        # its NIXL handshake, and that pull was said to end once a later engine step polled.
        # (A warm pull done by the next step is never said to wait, and the last pull's end
        # is said only if the engine steps again: neither is asserted.)
        watch = [line for line in shared.decode.log_text().splitlines() if KV_WATCH_MARK in line]
        assert any("handshake pending" in line for line in watch), shared.decode.tails()
        waited = [kv_request(line) for line in watch if " has waited " in line]
        ended = {kv_request(line) for line in watch if " ended after " in line}
        assert waited, watch
        assert waited[0] in ended, watch
        assert ended <= set(waited), watch

        # Decode side: kv_transfer_params -> the prefill instance, through the registry (a
        # handshake lookup is a worker's call: the reader token may not make it).
        assert params["remote_engine_id"] == engine.engine_id
        with shared.client("worker") as worker:
            remote = resolve_remote_engine(worker, params)
        assert remote.engine.group_id == "prefill-0"
        assert remote.dp_rank is None
        assert sorted(a.rank for a in remote.agents) == [0, 1]
        assert set(remote.side_channels().values()) == {("127.0.0.1", prefill.side_channel_port)}
        assert params["remote_port"] == prefill.side_channel_port
        assert all(a.kv["base_addrs"] and a.kv["mem_type"] == "DRAM" for a in remote.agents)

        decode = client.get_engine("decode-0")
        assert decode.ready
        assert decode.role == "decode"
        assert shared.prefill is not None
        report_the_cpu_path(shared.decode, shared.prefill, engine.compat, decode.compat)

        # Routers: both instances published where they serve, and a real vllm-router whose
        # command line names no instance, fed only by router-sync, serves PD through them.
        assert serving(client, "prefill-0", prefill.url).raw["serving"]["model"]
        serving(client, "decode-0", shared.decode.url)
        routing = shared.routing()
        via, FIGURES["PD through vllm-router: first answer after"] = routing.answer(
            shared.body(), 60
        )
        assert via.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        routing.said(f"Add Prefill [HTTP:127.0.0.1:{prefill.port}", 5)
    assert split_dp_suffix(f"{engine.engine_id}_dp3") == (engine.engine_id, 3)


def test_relaunched_prefill_gets_a_new_generation(shared: Shared) -> None:
    with shared.client() as client:
        if shared.prefill is None or "registry" not in shared.prefill.name:
            _start_prefill(shared, "prefill-registry", plugin=True)
        old = client.get_engine("prefill-0")
        assert shared.prefill is not None
        old_side_channel = shared.prefill.side_channel_port
        # The prefill crashes (kill -9: nothing deregisters) while decode stays up. Decode
        # follows the engines it loaded on the registry's watch: once the ranks' 10 s leases
        # lapse, it hands the engine to vLLM's own release.
        released_before = metric(
            shared.decode.url, "engine_registry_remote_engines_released_total", 'cause="not_ready"'
        )
        since = len(shared.decode.log_text())
        killed = time.time()
        shared.prefill.kill()
        shared.prefill = None
        FIGURES["decode released the killed prefill's engine after"] = logged(
            shared.decode, f"releasing remote engine {old.engine_id}", 30, since
        )
        deadline = time.monotonic() + 15  # the other rank's lease may lapse a little later
        while client.get_engine("prefill-0").registered_ranks and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get_engine("prefill-0").registered_ranks == []

        prefill = shared.prefill = shared.prefill_instance("prefill-relaunch", plugin=True)
        prefill.start()
        FIGURES["prefill-relaunch: healthy after (decode up)"] = prefill.wait_healthy(START_S)
        new = client.get_engine("prefill-0")
        assert new.generation == old.generation + 1
        assert new.engine_id != old.engine_id
        assert new.ready
        with pytest.raises(EngineSuperseded) as superseded:
            resolve_remote_engine(client, old.engine_id)
        assert superseded.value.current_engine_id == new.engine_id

        own = complete(prefill.url, shared.body())
        answer, params = shared.pd(prefill)
        assert answer.status_code == 200, (answer.text[:1000], shared.decode.tails())
        assert params["remote_engine_id"] == new.engine_id
        assert answer.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        # vLLM freed the old engine's NIXL state at an engine step: decode holds one engine.
        logged(shared.decode, f"freed the NIXL state of remote engine {old.engine_id}", 30, since)
        assert metric(shared.decode.url, "engine_registry_remote_engines") == 1
        released = metric(
            shared.decode.url, "engine_registry_remote_engines_released_total", 'cause="not_ready"'
        )
        assert released == released_before + 1, shared.decode.tails()
        stale_request_fails_at_once(
            shared.decode, shared.body(), params, old.engine_id, old_side_channel
        )

        # The router follows the relaunch on another port without a restart, and dropped the
        # old prefill: router-sync withdrew it, vllm-router let it expire.
        routing = shared.routing()
        serving(client, "prefill-0", prefill.url)
        via, FIGURES["PD through vllm-router after the relaunch"] = routing.answer(
            shared.body(), 30
        )
        assert via.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        routing.said(f"offer prefill prefill-0 (generation {new.generation}", 5)
        routing.said(f"withdraw prefill prefill-0 (generation {old.generation}", 5)
        # Each node's registry requests, from its launch to the kill (prefill) or to now.
        until = {"prefill-0": killed, "decode-0": time.time()}
        streamed = keepalive_renewals(shared.registry.url)
        REQUESTS["keep-alive renewals, every node"] = str(streamed)
        report_and_check(shared.registry.log_path, shared.launches, until, REQUESTS, streamed)
        # A decode that stops leaves the router once the registry no longer has it ready.
        decode_port = shared.decode.port
        shared.decode.stop()
        shared.decode_process = None
        FIGURES["stopped decode withdrawn from vllm-router after"] = routing.said(
            "withdraw decode decode-0", 45
        )
        routing.said(f"Remove Decode [HTTP:127.0.0.1:{decode_port}", 10)

        # Side-channel mode takes vLLM's own way: the closed port fails the request the
        # registry mode served (test_with_the_plugin_prefill_to_decode_works), the real one
        # works.
        side = shared.decode_process = shared.decode_instance(
            ENGINE_REGISTRY_HANDSHAKE="side-channel"
        ).start()
        side.wait_healthy(START_S)
        refused, _ = pd_complete(
            prefill.url,
            side.url,
            shared.body(),
            decode_logs=side.log_text,
            side_channel_port=free_port(),
        )
        assert refused.status_code != 200, refused.text[:500]
        for _ in range(3):  # vLLM may still be winding down the failed handshake: its call
            time.sleep(3.0)
            again, _ = shared.pd(prefill)
            if again.status_code == 200:
                break
        assert again.status_code == 200, (again.text[:1000], side.tails())
        path, FIGURES["decode handshake over the side channel"], _ = handshake_seconds(
            side, new.engine_id
        )
        assert path == "side channel"
        assert metric(side.url, "engine_registry_handshakes_total", 'path="registry"') == 0
    shared.prefill.stop()
    shared.prefill = None
