"""Hostile serving publications (issue #39, item 5) against a real registry process: what is
validated is what is stored. A URL or bootstrap address with control characters, NUL,
credentials, an unspecified host in any spelling, a zero or absent port, non-ASCII digits,
or a model name with a newline is refused (422, the field named); what is accepted is
stored normalized, and that normalized text is what every reader (the engine, the watch
line, ``/instances``) gets. router-sync quotes the URL it cannot use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from registry_client.router_sync.offers import offer
from tests.support.hostile import assert_problem, open_engine, serve

pytestmark = pytest.mark.faults

GOOD = {"url": "http://10.0.0.1:8100", "model": "m", "bootstrap": "10.0.0.1:5600"}

REFUSED = [
    ("url", "http://10.0.\n0.1:8100"),  # urlsplit drops the newline; the raw text kept it
    ("url", "http://10.0.0.1:8100\n"),
    ("url", "http://10.0.\t0.1:8100"),
    ("url", "http://10.0.0.1\x00:8100"),
    ("url", "http://user:secret@10.0.0.1:8100"),
    ("url", "http://user@10.0.0.1:8100"),
    ("url", "http://[::ffff:0.0.0.0]:8100"),
    ("url", "http://[::]:8100"),
    ("url", "http://[0:0:0:0:0:0:0:0]:8100"),
    ("url", "http://0.0.0.0:8100"),
    ("url", "http://10.0.0.1:0"),
    ("url", "http://10.0.0.1:"),
    ("url", "http://10.0.0.1"),
    ("url", "http://10.0.0.1:\uff18\uff11\uff10\uff10"),  # fullwidth digits
    ("url", "http://1\u00b2.0.0.1:8100"),
    ("url", "http://10.0.0.1:8100/?next=x"),
    ("url", "http://10.0.0.1:8100/#frag"),
    ("url", "http://::1:8100"),  # IPv6 without brackets
    ("url", "grpc://10.0.0.1:50051/path{}<>|^`"),  # gRPC has no path
    ("url", "grpc://10.0.0.1:50051/v1"),
    ("url", "http://10.0.0.1:8100/v1{}<>|^`"),  # not RFC 3986 unencoded
    ("url", 'http://10.0.0.1:8100/a"b\\c'),
    ("bootstrap", "10.0.0.1:5600\n"),
    ("bootstrap", "10.0.\r\n0.1:5600"),
    ("bootstrap", "10.0.0.1:\u0665\u0666\u0660\u0660"),  # Arabic-Indic digits: int() takes them
    ("bootstrap", "10.0.0.1:\uff15\uff16\uff10\uff10"),
    ("bootstrap", "0.0.0.0:5600"),
    ("bootstrap", "[::ffff:0.0.0.0]:5600"),
    ("bootstrap", "10.0.0.1:0"),
    ("bootstrap", "host\x00name:5600"),
    ("bootstrap", "[10.0.0.1]:5600"),
    ("model", "m\ninfo router-sync: offer prefill forged"),
    ("model", "m\x00"),
    ("model", "m\u2028"),
]

NORMALIZED = [
    ({"url": "HTTP://Router.Example.:8100/"}, {"url": "http://router.example:8100"}),
    ({"url": "http://[0:0:0:0:0:0:0:1]:8100/v1/"}, {"url": "http://[::1]:8100/v1"}),
    ({"url": "https://10.0.0.1:0443"}, {"url": "https://10.0.0.1:443"}),
    ({"url": "GRPC://10.0.0.1:50051/"}, {"url": "grpc://10.0.0.1:50051"}),
    ({"url": "http://h:1/v1/a%20b;x=1@y"}, {"url": "http://h:1/v1/a%20b;x=1@y"}),
    ({"bootstrap": "Node-7.Example:05600"}, {"bootstrap": "node-7.example:5600"}),
    ({"bootstrap": "[0:0::1]:5600"}, {"bootstrap": "[::1]:5600"}),
    ({"bootstrap": "fe80:0::1:5600"}, {"bootstrap": "fe80::1:5600"}),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    where = tmp_path_factory.mktemp("serving-hostile")
    proc = serve(where, where / "registry.db")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def http(registry: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=registry.url, timeout=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def engine(http: httpx.Client) -> dict[str, Any]:
    return open_engine(http, f"serving-{os.urandom(4).hex()}")


def publish(http: httpx.Client, engine: dict[str, Any], **fields: Any) -> httpx.Response:
    body = {"engine_id": engine["engine_id"], **GOOD, **fields}
    return http.put(f"/tp-groups/{engine['group_id']}/engine/serving", json=body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_a_hostile_serving_field_is_refused_and_nothing_is_stored(
    http: httpx.Client, engine: dict[str, Any], field: str, value: str
) -> None:
    assert publish(http, engine).status_code == 200  # a known good publication first
    body = assert_problem(publish(http, engine, **{field: value}), 422, "invalid_request")
    assert any(e["loc"][-1] == field for e in body["errors"]), body
    assert value not in body["detail"] or value.isprintable(), "the raw value echoed unquoted"
    stored = http.get(f"/tp-groups/{engine['group_id']}/engine").json()["serving"]
    assert {k: stored[k] for k in GOOD} == GOOD, stored


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sent", "kept"), NORMALIZED)
def test_what_is_stored_and_read_is_the_normalized_text_that_was_validated(
    http: httpx.Client, engine: dict[str, Any], sent: dict[str, str], kept: dict[str, str]
) -> None:
    answer = publish(http, engine, **sent)
    assert answer.status_code == 200, answer.text
    expected = {**GOOD, **kept}
    assert {k: answer.json()["serving"][k] for k in GOOD} == expected
    stored = http.get(f"/tp-groups/{engine['group_id']}/engine").json()["serving"]
    assert {k: stored[k] for k in GOOD} == expected
    listed = http.get("/tp-groups").json()["groups"]
    [mine] = [g for g in listed if g["group_id"] == engine["group_id"]]
    assert {k: mine["serving"][k] for k in GOOD} == expected


def test_router_sync_quotes_a_url_it_cannot_use() -> None:
    # A record written before this validation (or by another writer) may still carry it.
    serving = {"url": "ftp://x\ninfo router-sync: offer prefill forged", "model": "m"}
    engine = SimpleNamespace(
        group_id="p-0",
        engine_id="e" * 36,
        generation=1,
        role="prefill",
        ready=True,
        created_at="2026-12-03T00:00:00Z",
        missing_ranks=[],
        compat={},
        raw={"serving": serving},
    )
    _, left_out = offer([engine], None)
    assert "\n" not in left_out["p-0"], left_out
    assert "'ftp://x\\ninfo" in left_out["p-0"], left_out
