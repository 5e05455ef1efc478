"""Hostile input against a real registry process (issue #15): free-form JSON nested past a
depth limit, non-finite numbers, lone surrogates, odd request ids, bodies on bodyless routes,
and a handshake whose plan is as large as the contract allows. Each is refused cleanly (422 or
413, problem+json) or answered cheaply, and the registry stays healthy afterwards: the same
with the fast path on and off (``mode``; tests/app/server/test_parity.py has the limits)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.schemas import MAX_TP_SIZE
from harness.server import RegistryProcess
from tests.support.faults import agent_body
from tests.support.hostile import (
    FAST_PATHS,
    assert_problem,
    open_engine,
    path_env,
    raw_exchange,
    serve,
)

pytestmark = pytest.mark.faults

# The depth the fixed service allows inside a kv extra (nesting levels); tests keep clear of
# the exact boundary on both sides, so an off-by-one in how levels are counted does not matter.
KV_DEPTH_LIMIT = 32
ACCEPTED_DEPTH = KV_DEPTH_LIMIT // 2
REFUSED_DEPTHS = [KV_DEPTH_LIMIT * 2, 200, 1000]


@pytest.fixture(scope="module", params=FAST_PATHS)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[RegistryProcess]:
    where = tmp_path_factory.mktemp("hostile")
    proc = serve(where, where / "registry.db", env=path_env(mode))
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def http(shared: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared.url, timeout=10.0) as c:
        yield c


@pytest.fixture
def client(tmp_path: Path, mode: str) -> Iterator[httpx.Client]:
    """A fresh registry of its own, on ``mode``."""
    proc = serve(tmp_path, tmp_path / "registry.db", env=path_env(mode))
    try:
        with httpx.Client(base_url=proc.url, timeout=30.0) as c:
            yield c
    finally:
        proc.kill()


_gids = iter(range(1_000_000))


def gid(prefix: str) -> str:
    return f"{prefix}-{next(_gids)}-{time.monotonic_ns() % 10**9}"


def nested_list(depth: int) -> str:
    """``[[[…]]]``: a JSON value ``depth`` levels deep, as text (no recursion to build it)."""
    return "[" * depth + "]" * depth


def agent_json(engine_id: str, rank: int, kv_extra: str) -> bytes:
    """An agent registration whose ``kv`` carries ``"extra": <kv_extra>``, spliced in as raw
    JSON text (so NaN, lone surrogate escapes and deep nesting reach the server verbatim)."""
    body = agent_body(engine_id, rank, ttl_s=600)
    kv = json.dumps(body.pop("kv"))[:-1] + f', "extra": {kv_extra}}}'
    return (json.dumps(body)[:-1] + f', "kv": {kv}}}').encode()


def names_kv(problem: dict[str, Any]) -> bool:
    """The 422 says which field: ``kv`` in an error's loc, or in the detail."""
    locs = [e.get("loc", []) for e in problem.get("errors", [])]
    return any("kv" in [str(p) for p in loc] for loc in locs) or "kv" in problem["detail"]


# -- 1. JSON depth ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", REFUSED_DEPTHS)
def test_a_kv_extra_nested_past_the_limit_is_refused_and_the_registry_stays_healthy(
    client: httpx.Client, depth: int
) -> None:
    group = gid("deep")
    engine = open_engine(client, group, tp_size=2, compat={"model": "llama"})
    eid = engine["engine_id"]
    put = client.put(f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0, ttl_s=600))
    assert put.status_code == 201, put.text

    # Every failure is collected, so one run shows all that a deep value breaks.
    broken: list[str] = []
    hostile = client.put(
        f"/tp-groups/{group}/engine/agents/1",
        content=agent_json(eid, 1, f'{{"deep": {nested_list(depth)}}}'),
        headers={"content-type": "application/json"},
    )
    try:
        problem = assert_problem(hostile, 422, "invalid_request")
        if depth <= 200 and not names_kv(problem):
            broken.append(f"the 422 does not name the kv field: {problem}")
    except AssertionError as exc:
        broken.append(f"PUT agent with kv nested {depth} deep: {exc}")

    checks: list[tuple[str, str, str, Any, int]] = [
        ("GET /tp-groups", "GET", "/tp-groups", None, 200),
        ("GET /metrics", "GET", "/metrics", None, 200),
        ("GET the group", "GET", f"/tp-groups/{group}/engine", None, 200),
        ("GET the engine", "GET", f"/engines/{eid}", None, 200),
        # Rank 0 is live and is the only target of a decode rank 0 of TP 2.
        ("handshake", "POST", f"/engines/{eid}/handshake", {"tp_size": 2, "rank": 0}, 200),
        (
            "heartbeat",
            "POST",
            f"/tp-groups/{group}/engine/agents/0/heartbeat",
            {"engine_id": eid},
            200,
        ),
        (
            "relaunch",
            "PUT",
            f"/tp-groups/{group}/engine",
            {"launch_id": f"relaunch-{depth}", "tp_size": 2, "role": "prefill"},
            201,
        ),
        ("DELETE the group", "DELETE", f"/tp-groups/{group}", None, 204),
    ]
    for what, method, path, body, want in checks:
        try:
            resp = client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            broken.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        if resp.status_code != want:
            broken.append(f"{what}: {resp.status_code} (want {want}) {resp.text[:200]}")
    assert not broken, "\n".join(broken)


@pytest.mark.timeout(30)
def test_a_kv_extra_nested_within_the_limit_is_kept_as_given(http: httpx.Client) -> None:
    group = gid("shallow")
    engine = open_engine(http, group)
    value = json.loads(nested_list(ACCEPTED_DEPTH))
    put = http.put(
        f"/tp-groups/{group}/engine/agents/0",
        content=agent_json(engine["engine_id"], 0, json.dumps({"deep": value})),
        headers={"content-type": "application/json"},
    )
    assert put.status_code == 201, put.text
    assert put.json()["kv"]["extra"] == {"deep": value}
    shake = http.post(f"/engines/{engine['engine_id']}/handshake", json={"tp_size": 1, "rank": 0})
    assert shake.status_code == 200, shake.text
    assert shake.json()["targets"][0]["kv"]["extra"] == {"deep": value}
    assert http.get("/tp-groups").status_code == 200


# -- non-finite numbers ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e309", '{"a": [1, -1e400]}'])
def test_a_non_finite_number_in_a_kv_extra_is_refused(http: httpx.Client, value: str) -> None:
    group = gid("nonfinite")
    engine = open_engine(http, group)
    resp = http.put(
        f"/tp-groups/{group}/engine/agents/0",
        content=agent_json(engine["engine_id"], 0, value),
        headers={"content-type": "application/json"},
    )
    assert_problem(resp, 422, "invalid_request")
    assert http.get(f"/tp-groups/{group}/engine").status_code == 200
    assert http.get("/tp-groups").status_code == 200


# -- 4. lone surrogates -----------------------------------------------------------------------


def local_port(resp: httpx.Response) -> int:
    """The client-side port of the connection that carried ``resp``."""
    stream = resp.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


def surrogate_requests(engine: dict[str, Any]) -> list[tuple[str, str, str, bytes]]:
    eid, group = engine["engine_id"], engine["group_id"]
    return [
        (
            "open, compat value",
            "PUT",
            f"/tp-groups/{group}-s1/engine",
            b'{"launch_id": "l-s1", "tp_size": 1, "role": "prefill", "compat": {"k": "\\ud800"}}',
        ),
        (
            "open, compat key",
            "PUT",
            f"/tp-groups/{group}-s2/engine",
            b'{"launch_id": "l-s2", "tp_size": 1, "role": "prefill", "compat": {"\\udfff": 1}}',
        ),
        (
            "agent, kv extra value",
            "PUT",
            f"/tp-groups/{group}/engine/agents/0",
            agent_json(eid, 0, '"\\ud800"'),
        ),
        (
            "agent, kv extra key",
            "PUT",
            f"/tp-groups/{group}/engine/agents/0",
            agent_json(eid, 0, '{"\\ud800x": 1}'),
        ),
        (
            "handshake, compat value",
            "POST",
            f"/engines/{eid}/handshake",
            b'{"tp_size": 1, "rank": 0, "compat": {"model": "\\ud800"}}',
        ),
    ]


@pytest.mark.timeout(30)
def test_lone_surrogates_are_refused_and_the_keep_alive_connection_serves_the_next_request(
    shared: RegistryProcess,
) -> None:
    with httpx.Client(base_url=shared.url, timeout=10.0) as http:
        engine = open_engine(http, gid("surrogate"), compat={"model": "llama"})
        port = local_port(http.get("/healthz"))
        broken: list[str] = []
        for what, method, path, body in surrogate_requests(engine):
            try:
                resp = http.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
                assert_problem(resp, 422, "invalid_request")
            except (AssertionError, httpx.HTTPError) as exc:
                broken.append(f"{what}: {type(exc).__name__}: {exc}")
            try:
                after = http.get(f"/tp-groups/{engine['group_id']}/engine")
            except httpx.HTTPError as exc:
                broken.append(f"after {what}: the next request failed: {exc!r}")
                continue
            if after.status_code != 200:
                broken.append(f"after {what}: GET the group answered {after.status_code}")
            if local_port(after) != port:
                broken.append(f"after {what}: the server closed the keep-alive connection")
                port = local_port(after)
        assert not broken, "\n".join(broken)


# -- X-Request-ID ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sent", [b"caf\xe9", b"\xff\xfe-id", b"r\xc3\xa9q-utf8"])
def test_a_non_ascii_request_id_is_echoed_unaltered_or_replaced_by_a_fresh_one(
    shared: RegistryProcess, sent: bytes
) -> None:
    answer = raw_exchange(
        shared.port,
        b"GET /healthz HTTP/1.1\r\nHost: registry\r\nX-Request-ID: "
        + sent
        + b"\r\nConnection: close\r\n\r\n",
    )
    assert answer.status == 200, answer
    echoed = answer.header(b"x-request-id")
    assert echoed is not None, answer.headers
    assert echoed.isascii(), f"sent {sent!r}, got back {echoed!r}"
    assert echoed == sent or re.fullmatch(rb"[0-9a-f]{32}", echoed), (
        f"sent {sent!r}, got back {echoed!r}: neither the same bytes nor a fresh id"
    )


# -- 10. body size before state on bodyless routes -------------------------------------------

BODY_LIMIT = 1024


@pytest.fixture(scope="module")
def small_body(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[httpx.Client]:
    where = tmp_path_factory.mktemp("bodylimit")
    env = path_env(mode, REGISTRY_MAX_BODY_BYTES=str(BODY_LIMIT))
    proc = serve(where, where / "registry.db", env=env)
    try:
        with httpx.Client(base_url=proc.url, timeout=10.0) as c:
            yield c
    finally:
        proc.kill()


def oversized(chunked: bool) -> bytes | Iterator[bytes]:
    body = json.dumps({"pad": "x" * 2 * BODY_LIMIT}).encode()
    return iter([body[:BODY_LIMIT], body[BODY_LIMIT:]]) if chunked else body


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_on_delete_group_answers_413_and_the_group_stays(
    small_body: httpx.Client, chunked: bool
) -> None:
    group = gid("bigdelete")
    open_engine(small_body, group)
    resp = small_body.request("DELETE", f"/tp-groups/{group}", content=oversized(chunked))
    assert_problem(resp, 413, "payload_too_large")
    assert small_body.get(f"/tp-groups/{group}/engine").status_code == 200, "the group is gone"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_on_delete_agent_answers_413_before_the_engine_id_check(
    small_body: httpx.Client, chunked: bool
) -> None:
    group = gid("bigdereg")
    open_engine(small_body, group)
    resp = small_body.request(
        "DELETE", f"/tp-groups/{group}/engine/agents/0?engine_id=zz", content=oversized(chunked)
    )
    assert_problem(resp, 413, "payload_too_large")


# -- 3. handshake planning is linear ---------------------------------------------------------

HEALTHZ_PATIENCE_S = 5.0
HANDSHAKE_PATIENCE_S = 10.0


@pytest.mark.timeout(60)
def test_a_handshake_against_the_largest_tp_size_answers_fast_and_healthz_stays_fast(
    tmp_path: Path, mode: str
) -> None:
    # A server of its own, killed with SIGKILL: a slow handshake must not hold up the others.
    server = serve(tmp_path, tmp_path / "registry.db", env=path_env(mode))
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            engine = open_engine(http, "wide", tp_size=MAX_TP_SIZE)
        handshake_while_probing_healthz(server, engine["engine_id"])
    finally:
        server.kill()


def handshake_while_probing_healthz(server: RegistryProcess, engine_id: str) -> None:
    done = threading.Event()
    healthz: list[float] = []

    def shake() -> tuple[httpx.Response | None, float]:
        t0 = time.monotonic()
        try:
            with httpx.Client(base_url=server.url, timeout=HANDSHAKE_PATIENCE_S) as c:
                body = {"tp_size": 1, "rank": 0}
                return c.post(f"/engines/{engine_id}/handshake", json=body), time.monotonic() - t0
        except httpx.TimeoutException:
            return None, time.monotonic() - t0
        finally:
            done.set()

    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=10.0) as probe:
        probe.get("/healthz")  # connect before the handshake starts
        future = pool.submit(shake)
        while not done.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(httpx.TimeoutException):  # counted as the whole wait
                assert probe.get("/healthz", timeout=HEALTHZ_PATIENCE_S).status_code == 200
            healthz.append(time.monotonic() - t0)
            time.sleep(0.02)
        answer, seconds = future.result(timeout=40)
    slowest = max(healthz, default=0.0)
    what = "no answer" if answer is None else f"answered {answer.status_code}"
    fast = answer is not None and seconds < 2.0 and slowest < 0.5
    assert fast, (
        f"the handshake {what} after {seconds:.2f} s (want 503 within 2 s); /healthz took up "
        f"to {slowest:.2f} s meanwhile (want < 0.5 s)"
    )
    assert answer is not None
    body = assert_problem(answer, 503, "not_ready")
    assert body["missing_ranks"][:3] == [0, 1, 2]
