"""sync_engine_id in a one-rank gloo world, and each rank's diagnosis of a disagreement.

Groups of several ranks on two "nodes" run under torchrun in test_identity_torchrun.py; here
the registry's answers are scripted so that every cause can be produced on purpose.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
import torch.distributed as dist

from registry_client.client import RegistryClient
from registry_client.errors import EngineIdentityError
from workers import identity
from workers.identity import EngineIdentity
from workers.tools.procs import free_port

pytestmark = pytest.mark.workers

Handler = Callable[[httpx.Request], httpx.Response]


def engine(engine_id: str = "e1", group_id: str = "g", generation: int = 1) -> dict[str, object]:
    return {
        "group_id": group_id,
        "engine_id": engine_id,
        "generation": generation,
        "launch_id": "l",
        "tp_size": 1,
        "role": "prefill",
        "compat": {},
        "created_at": "t",
        "ready": False,
        "registered_ranks": [],
        "missing_ranks": [0],
    }


def problem(status: int, code: str, **extra: object) -> httpx.Response:
    body = {"title": code, "status": status, "detail": code, "code": code, **extra}
    return httpx.Response(status, content=json.dumps(body))


def client_for(handler: Handler, timeout_s: float = 2.0) -> RegistryClient:
    return RegistryClient(
        "http://registry", transport=httpx.MockTransport(handler), timeout_s=timeout_s
    )


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_world")
def test_rank_zero_opens_the_engine_with_a_fresh_launch_id_and_returns_its_identity() -> None:
    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("PUT", "/tp-groups/g/engine")
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json=engine("e7", generation=3))

    got = identity.sync_engine_id(
        client_for(handler), "g", tp_size=1, role="prefill", compat={"model": "m"}
    )
    assert got == EngineIdentity("g", "e7", 3, "http://registry", got.launch_id, "registry")
    assert bodies[0]["launch_id"] == got.launch_id
    assert len(got.launch_id) == 32
    assert bodies[0]["compat"] == {"model": "m"}


@pytest.mark.usefixtures("one_rank_world")
def test_an_unreachable_registry_fails_the_group_with_that_cause() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(EngineIdentityError) as info:
        identity.sync_engine_id(client_for(handler), "g", tp_size=1, role="prefill", timeout_s=0.3)
    assert info.value.causes == {0: identity.REGISTRY_UNREACHABLE}


@pytest.mark.usefixtures("one_rank_world")
def test_the_fallback_takes_rank_zeros_own_id_and_says_so_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with caplog.at_level(logging.WARNING, logger="workers.identity"):
        got = identity.sync_engine_id(
            client_for(handler), "g", tp_size=1, role="prefill", allow_fallback=True, timeout_s=0.3
        )
    assert got.source == "fallback"
    assert got.generation == 0
    assert "REGISTRY UNREACHABLE" in caplog.text
    assert got.engine_id in caplog.text


@pytest.mark.usefixtures("one_rank_world")
def test_a_refused_open_fails_the_group_with_the_registrys_reason() -> None:
    client = client_for(lambda r: problem(409, "group_conflict"))
    with pytest.raises(EngineIdentityError, match="group_conflict") as info:
        identity.sync_engine_id(client, "g", tp_size=1, role="prefill")
    assert info.value.causes == {0: identity.OPEN_FAILED}


@pytest.mark.usefixtures("one_rank_world")
@pytest.mark.parametrize(("status", "code"), [(401, "unauthorized"), (403, "forbidden")])
def test_a_refused_token_fails_the_group_naming_the_token(status: int, code: str) -> None:
    client = client_for(lambda r: problem(status, code))
    with pytest.raises(EngineIdentityError, match="ENGINE_REGISTRY_TOKEN") as info:
        identity.sync_engine_id(client, "g", tp_size=1, role="prefill")
    assert info.value.causes == {0: identity.UNAUTHORIZED}
    assert f"{status} {code}" in info.value.details[0]


@pytest.mark.usefixtures("one_rank_world")
def test_a_tp_size_other_than_the_groups_is_refused_before_anything_is_opened() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        identity.sync_engine_id(
            client_for(lambda r: httpx.Response(500)), "g", tp_size=2, role="prefill"
        )


@pytest.mark.usefixtures("one_rank_world")
def test_the_vllm_drop_in_sets_kv_transfer_config_engine_id() -> None:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="made-up"))
    client = client_for(lambda r: httpx.Response(201, json=engine("issued")))
    got = identity.sync_kv_transfer_engine_id(config, client, "g", tp_size=1, role="prefill")
    assert config.kv_transfer_config.engine_id == "issued" == got.engine_id


def test_the_vllm_drop_in_refuses_a_config_without_kv_transfer_config() -> None:
    with pytest.raises(ValueError, match="kv_transfer_config"):
        identity.sync_kv_transfer_engine_id(
            SimpleNamespace(),
            client_for(lambda r: httpx.Response(500)),
            "g",
            tp_size=1,
            role="prefill",
        )


ANNOUNCED = EngineIdentity("g", "e1", 1, "http://rank0-registry", "l", "registry")


def diagnose(answers: dict[str, httpx.Response], group_id: str = "g") -> identity._Verdict:
    def handler(request: httpx.Request) -> httpx.Response:
        return answers[request.url.path]

    return identity._diagnose(client_for(handler), group_id, 1, ANNOUNCED, timeout_s=1)


def test_a_rank_that_fetches_the_same_engine_agrees() -> None:
    verdict = diagnose({"/tp-groups/g/engine": httpx.Response(200, json=engine("e1"))})
    assert verdict.ok


def test_a_rank_whose_registry_never_issued_the_id_blames_a_different_registry() -> None:
    verdict = diagnose(
        {
            "/tp-groups/g/engine": httpx.Response(200, json=engine("other")),
            "/engines/e1": problem(404, "not_found"),
        }
    )
    assert (verdict.ok, verdict.cause) == (False, identity.DIFFERENT_REGISTRY)
    assert "http://rank0-registry" in verdict.detail
    assert "http://registry" in verdict.detail


def test_a_rank_that_sees_a_newer_generation_blames_a_superseding_launch() -> None:
    verdict = diagnose(
        {
            "/tp-groups/g/engine": httpx.Response(200, json=engine("e2", generation=2)),
            "/engines/e1": problem(
                410, "engine_superseded", current_engine_id="e2", current_generation=2
            ),
        }
    )
    assert verdict.cause == identity.SUPERSEDED
    assert "e2 (generation 2)" in verdict.detail


def test_a_rank_launched_for_another_group_id_blames_the_group_id() -> None:
    verdict = diagnose(
        {
            "/tp-groups/g-typo/engine": problem(404, "not_found"),
            "/engines/e1": httpx.Response(200, json=engine("e1", group_id="g")),
        },
        group_id="g-typo",
    )
    assert verdict.cause == identity.DIFFERENT_GROUP
    assert "'g-typo'" in verdict.detail


def test_a_rank_whose_token_its_registry_refuses_says_so() -> None:
    verdict = diagnose({"/tp-groups/g/engine": problem(401, "unauthorized")})
    assert (verdict.ok, verdict.cause) == (False, identity.UNAUTHORIZED)
    assert "worker role" in verdict.detail


def test_a_rank_whose_registry_is_unreachable_says_so() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    verdict = identity._diagnose(client_for(handler, 0.2), "g", 1, ANNOUNCED, timeout_s=0.2)
    assert verdict.cause == identity.REGISTRY_UNREACHABLE


def test_a_fallback_announcement_is_accepted_without_asking_the_registry() -> None:
    fallback = EngineIdentity("g", "mine", 0, "", "l", "fallback")
    verdict = identity._diagnose(
        client_for(lambda r: httpx.Response(500)), "g", 1, fallback, timeout_s=1
    )
    assert verdict.ok


def test_local_engine_ids_are_stable_within_a_node_process_tree() -> None:
    assert identity.local_engine_id() == identity.local_engine_id()
