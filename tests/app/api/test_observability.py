"""/healthz, /readyz, /metrics, /docs, /openapi.json, and X-Request-ID on every answer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.server import RegistryProcess
from tests.app.api.conftest import Api, agent_body, new_gid, sqlite_url

pytestmark = pytest.mark.api


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """A server of its own: gauges count every group, so no other module's leases may
    expire under these tests."""
    directory = tmp_path_factory.mktemp("observability")
    with RegistryProcess(sqlite_url(directory), log_path=directory / "registry.log") as proc:
        yield proc


CONTRACT_PATHS = {
    "/tp-groups/{group_id}/engine": {"put", "get"},
    "/tp-groups/{group_id}/engine/agents/{rank}": {"put", "delete"},
    "/tp-groups/{group_id}/engine/agents/{rank}/heartbeat": {"post"},
    "/tp-groups": {"get"},
    "/tp-groups/{group_id}": {"delete"},
    "/engines/{engine_id}": {"get"},
    "/engines/{engine_id}/handshake": {"post"},
    "/healthz": {"get"},
    "/readyz": {"get"},
    "/metrics": {"get"},
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(api: httpx.Client) -> Samples:
    resp = api.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_healthz_answers_200(api: httpx.Client) -> None:
    resp = api.get("/healthz")
    assert resp.status_code == 200
    assert resp.json()["status"] == "ok"


def test_readyz_answers_200_naming_the_store(api: httpx.Client) -> None:
    resp = api.get("/readyz")
    assert resp.status_code == 200
    assert resp.json()["store"].startswith("sqlite:///")


def test_metrics_count_requests_by_route_and_status(api: httpx.Client, reg: Api) -> None:
    before = scrape(api)
    group = new_gid()
    reg.open(group)
    api.get(f"/tp-groups/{new_gid()}/engine")
    after = scrape(api)
    route = "/tp-groups/{group_id}/engine"
    name = "registry_http_requests_total"
    for method, status in (("PUT", "201"), ("GET", "404")):
        labels = {"route": route, "method": method, "status": status}
        assert value(after, name, **labels) == value(before, name, **labels) + 1, labels
    assert any(n == "registry_http_request_duration_seconds_bucket" for n, _ in after)


def test_metrics_count_engines_opened(api: httpx.Client, reg: Api) -> None:
    before = value(scrape(api), "registry_engines_opened_total")
    group = new_gid()
    first = reg.open(group)
    reg.open(group)
    reg.open(group, launch_id=reg.engine(group)["launch_id"], expect=200)
    assert first["generation"] == 1
    assert value(scrape(api), "registry_engines_opened_total") == before + 2


def test_metrics_count_engine_id_mismatches_by_cause(api: httpx.Client, reg: Api) -> None:
    name = "registry_engine_id_mismatches_total"
    before = scrape(api)
    group = new_gid()
    old = reg.open(group, tp_size=1)
    reg.open(group, tp_size=1)
    other = reg.open(new_gid(), tp_size=1)
    url = f"/tp-groups/{group}/engine/agents/0"
    for engine_id in (old["engine_id"], other["engine_id"], str(uuid.uuid4())):
        assert api.put(url, json=agent_body(engine_id, 0)).status_code == 409
    after = scrape(api)
    for cause in ("superseded", "other_group", "unknown"):
        assert value(after, name, cause=cause) == value(before, name, cause=cause) + 1, cause


def test_metrics_report_live_agents_and_ready_groups(api: httpx.Client, reg: Api) -> None:
    before = scrape(api)
    ready = reg.open(new_gid(), tp_size=2)
    reg.register_all(ready)
    partial = reg.open(new_gid(), tp_size=3)
    reg.register(partial, 0)
    after = scrape(api)
    assert value(after, "registry_live_agents") == value(before, "registry_live_agents") + 3
    assert value(after, "registry_ready_groups") == value(before, "registry_ready_groups") + 1


def test_docs_and_openapi_are_served(api: httpx.Client) -> None:
    docs = api.get("/docs")
    assert docs.status_code == 200
    assert "text/html" in docs.headers["content-type"]
    spec = api.get("/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for path, methods in CONTRACT_PATHS.items():
        assert path in paths, path
        assert methods <= set(paths[path]), (path, set(paths[path]))


def requests_to_try(api: httpx.Client, reg: Api) -> list[httpx.Request]:
    group = new_gid()
    engine = reg.open(group, tp_size=1)
    eid = engine["engine_id"]
    b = api.build_request
    return [
        b("GET", "/healthz"),
        b("GET", "/metrics"),
        b("GET", "/tp-groups"),
        b("GET", f"/tp-groups/{group}/engine"),
        b("GET", f"/tp-groups/{new_gid()}/engine"),  # 404
        b("PUT", f"/tp-groups/{group}/engine", content=b"{"),  # 422
        b("PUT", f"/tp-groups/{group}/engine/agents/0", json=agent_body(eid, 0)),
        b("PUT", f"/tp-groups/{group}/engine/agents/0", json=agent_body("nope", 0)),  # 409
        b("POST", f"/engines/{eid}/handshake", json={"tp_size": 1, "rank": 0}),
        b("DELETE", f"/tp-groups/{group}"),  # 204
        b("GET", f"/engines/{eid}"),  # 404
        b("GET", "/no/such/path"),
    ]


def test_every_answer_carries_a_request_id(api: httpx.Client, reg: Api) -> None:
    seen = set()
    for request in requests_to_try(api, reg):
        resp = api.send(request)
        rid = resp.headers.get("x-request-id")
        assert rid, (request.method, request.url, resp.status_code)
        seen.add(rid)
    assert len(seen) == len(requests_to_try(api, reg))


# Fixed ids (a fresh uuid each run): pytest-xdist's workers must collect the same names.
@pytest.mark.parametrize(
    "rid",
    ["my-request-42", "a" * 64, uuid.uuid4().hex],
    ids=["my-request-42", "64-characters", "a-fresh-uuid"],
)
def test_a_request_id_sent_by_the_client_is_echoed(api: httpx.Client, reg: Api, rid: str) -> None:
    for request in requests_to_try(api, reg):
        request.headers["X-Request-ID"] = rid
        resp = api.send(request)
        assert resp.headers.get("x-request-id") == rid, (request.method, request.url)


def test_metrics_show_the_process_and_the_tuned_garbage_collector(
    api: httpx.Client, reg: Api
) -> None:
    """process_* and python_gc_* for the serving process, whose young generation collects at
    10,000 objects (app/server/serve.py): 200 groups opened (each keeps records, keys, caches) cost
    at most a couple of young collections, not one every few requests."""
    before = scrape(api)
    for _ in range(200):
        reg.open(new_gid())
    after = scrape(api)
    names = {n for n, _ in after}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert name in names, name
    collections = "python_gc_collections_total"
    young = value(after, collections, generation="0") - value(before, collections, generation="0")
    # At Python's default (700) this loop collected the young generation 6 times.
    assert young <= 2, f"{young} young collections for 200 groups opened"
