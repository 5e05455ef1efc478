"""The client's policy (error mapping, retries, deadlines, failover) against scripted answers.

These use httpx.MockTransport only to script failures a real service will not produce on
demand; the contract itself is exercised against a real registry in test_client_contract.py.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable

import httpx
import pytest

from registry_client import errors
from registry_client.client import RegistryClient
from registry_client.models import KvSpec

pytestmark = pytest.mark.unit

Handler = Callable[[httpx.Request], httpx.Response]


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def make_client(
    handler: Handler, *, urls: list[str] | None = None, timeout_s: float = 5.0, **kw: object
) -> tuple[RegistryClient, FakeTime]:
    fake = FakeTime()
    client = RegistryClient(
        urls or ["http://a"],
        transport=httpx.MockTransport(handler),
        timeout_s=timeout_s,
        rng=random.Random(0),
        sleep=fake.sleep,
        clock=fake.clock,
        **kw,  # type: ignore[arg-type]
    )
    return client, fake


def problem(status: int, code: str, **extra: object) -> httpx.Response:
    body = {
        "type": "about:blank",
        "title": code,
        "status": status,
        "detail": f"d-{code}",
        "code": code,
        **extra,
    }
    return httpx.Response(
        status, content=json.dumps(body), headers={"content-type": "application/problem+json"}
    )


ENGINE = {
    "group_id": "g",
    "engine_id": "e1",
    "generation": 1,
    "launch_id": "l",
    "tp_size": 2,
    "role": "prefill",
    "compat": {},
    "created_at": "t",
    "ready": False,
    "registered_ranks": [],
    "missing_ranks": [0, 1],
    "agents": [],
}


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (422, "invalid_request", errors.InvalidRequest),
        (401, "unauthorized", errors.Unauthorized),
        (403, "forbidden", errors.Forbidden),
        (404, "not_found", errors.NotFound),
        (409, "group_conflict", errors.GroupConflict),
        (409, "launch_superseded", errors.LaunchSuperseded),
        (409, "engine_id_mismatch", errors.EngineIdMismatch),
        (409, "incompatible", errors.Incompatible),
        (410, "engine_superseded", errors.EngineSuperseded),
        (413, "payload_too_large", errors.PayloadTooLarge),
    ],
)
def test_each_problem_code_becomes_its_own_exception_and_is_never_retried(
    status: int, code: str, cls: type[errors.ProblemError]
) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return problem(status, code)

    client, fake = make_client(handler)
    with pytest.raises(cls) as info:
        client.resolve_engine("e1")
    assert info.value.status == status
    assert info.value.problem_code == code
    assert info.value.detail == f"d-{code}"
    assert len(calls) == 1
    assert fake.sleeps == []


def test_problem_members_are_exposed_as_typed_attributes() -> None:
    answers = iter(
        [
            problem(
                409,
                "engine_id_mismatch",
                cause="other_group",
                expected_engine_id="a",
                got_engine_id="b",
            ),
            problem(410, "engine_superseded", current_engine_id="e2", current_generation=2),
            problem(409, "incompatible", mismatches=[{"field": "dtype", "remote": 1, "local": 2}]),
            problem(409, "launch_superseded", current_generation=7),
        ]
    )
    client, _ = make_client(lambda r: next(answers))
    with pytest.raises(errors.EngineIdMismatch) as mismatch:
        client.heartbeat("g", 0, engine_id="b")
    assert (mismatch.value.cause, mismatch.value.expected_engine_id) == ("other_group", "a")
    assert mismatch.value.got_engine_id == "b"
    with pytest.raises(errors.EngineSuperseded) as gone:
        client.resolve_engine("e1")
    assert (gone.value.current_engine_id, gone.value.current_generation) == ("e2", 2)
    with pytest.raises(errors.Incompatible) as incompatible:
        client.handshake("e1", tp_size=1, rank=0)
    assert incompatible.value.mismatches == [{"field": "dtype", "remote": 1, "local": 2}]
    with pytest.raises(errors.LaunchSuperseded) as superseded:
        client.open_engine("g", launch_id="old", tp_size=1, role="prefill")
    assert superseded.value.current_generation == 7


def test_an_answer_without_a_code_is_classified_by_its_status() -> None:
    client, _ = make_client(lambda r: httpx.Response(404, text="nope"))
    with pytest.raises(errors.NotFound) as info:
        client.get_engine("g")
    assert "nope" in info.value.detail


def test_503_is_retried_with_growing_backoff_until_it_succeeds() -> None:
    answers = iter(
        [
            problem(503, "store_unavailable"),
            problem(503, "store_unavailable"),
            httpx.Response(200, json=ENGINE),
        ]
    )
    client, fake = make_client(lambda r: next(answers))
    engine = client.get_engine("g")
    assert engine.engine_id == "e1"
    assert len(fake.sleeps) == 2
    # registry_client.backoff: full jitter under a doubling cap, [0, 0.1] then [0, 0.2].
    assert 0 <= fake.sleeps[0] <= 0.1
    assert 0 <= fake.sleeps[1] <= 0.2


def test_pauses_are_full_jitter_and_a_retry_after_is_their_floor() -> None:
    overloaded = problem(503, "overloaded")
    overloaded.headers["retry-after"] = "2"
    ok = httpx.Response(200, json=ENGINE)
    answers = iter([overloaded, problem(429, "too_many_requests"), ok])
    client, fake = make_client(lambda r: next(answers), timeout_s=10)
    assert client.get_engine("g").engine_id == "e1"
    assert len(fake.sleeps) == 2  # the 429 was retried too
    assert 2.0 <= fake.sleeps[0] <= 2.1, "Retry-After: 2 is the first pause's floor"
    assert fake.sleeps[1] <= 0.2  # a later answer without one: back to the jittered pause
    assert client.last_retry_after_s == 2.0
    # Full jitter: across many clients the first pause spreads over the whole window.
    firsts: list[float] = []
    for seed in range(200):
        script = iter([problem(503, "store_unavailable"), httpx.Response(200, json=ENGINE)])
        transport = httpx.MockTransport(lambda r, script=script: next(script))
        c = RegistryClient(
            "http://a", transport=transport, rng=random.Random(seed), sleep=firsts.append
        )
        c.get_engine("g")
    assert min(firsts) < 0.02, min(firsts)
    assert max(firsts) > 0.08, max(firsts)


def test_a_503_that_outlasts_the_deadline_raises_the_last_problem() -> None:
    client, fake = make_client(lambda r: problem(503, "not_ready", missing_ranks=[1]), timeout_s=3)
    with pytest.raises(errors.NotReady) as info:
        client.handshake("e1", tp_size=2, rank=1)
    assert info.value.missing_ranks == [1]
    assert fake.now <= 3.0 + 1e-9
    assert len(fake.sleeps) >= 3


def test_connection_errors_fail_over_to_the_next_replica_at_once() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=ENGINE)

    client, fake = make_client(handler, urls=["http://a", "http://b"])
    assert client.get_engine("g").engine_id == "e1"
    assert seen == ["a", "b"]
    assert fake.sleeps == []
    # The replica that answered is tried first next time.
    client.get_engine("g")
    assert seen == ["a", "b", "b"]
    assert client.url == "http://b"


def test_urls_may_be_given_comma_separated() -> None:
    client = RegistryClient("http://a/, http://b")
    assert client.urls == ["http://a", "http://b"]
    client.close()


def test_no_replica_answering_raises_registry_unavailable_within_the_deadline() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client, fake = make_client(handler, urls=["http://a", "http://b"], timeout_s=2)
    with pytest.raises(errors.RegistryUnavailable) as info:
        client.list_groups()
    assert info.value.urls == ["http://a", "http://b"]
    assert info.value.attempts >= 2
    assert fake.now <= 2.0 + 1e-9


def test_the_bearer_token_is_sent_on_every_request() -> None:
    headers: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"groups": [ENGINE]})

    client, _ = make_client(handler, token="s3cret")
    assert [e.group_id for e in client.list_groups()] == ["g"]
    assert headers == ["Bearer s3cret"]


def test_wait_ready_is_passed_on_and_extends_the_attempts_deadline() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.params["wait_ready"] == "20"
        assert request.extensions["timeout"]["read"] > 20
        return httpx.Response(200, json={**ENGINE, "ready": True})

    client, _ = make_client(handler, timeout_s=5)
    assert client.get_engine("g", wait_ready_s=20).ready


def test_register_agent_sends_the_metadata_blob_as_base64_and_reports_creation() -> None:
    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        answer = {
            "engine_id": "e1",
            "agent_name": "a0",
            "host": "10.0.0.1",
            "generation": 1,
            "registered_at": "t",
            "expires_at": "t2",
            "kv": {},
        }
        return httpx.Response(201 if len(bodies) == 1 else 200, json=answer)

    client, _ = make_client(handler)
    kv = KvSpec("DRAM", 0, [4096], 8, 512, 2)
    record, created = client.register_agent(
        "g",
        0,
        engine_id="e1",
        agent_name="a0",
        agent_metadata=b"\x00\xffmd",
        host="10.0.0.1",
        kv=kv,
        ttl_s=10,
    )
    assert created
    assert record.expires_at == "t2"
    assert base64.b64decode(str(bodies[0]["agent_metadata"])) == b"\x00\xffmd"
    assert bodies[0]["kv"] == kv.to_json()
    assert bodies[0]["ttl_s"] == 10
    _, created_again = client.register_agent(
        "g", 0, engine_id="e1", agent_name="a0", agent_metadata=b"md", host="h", kv=kv
    )
    assert not created_again
    assert "ttl_s" not in bodies[1]
