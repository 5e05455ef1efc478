"""Where instances serve (``PUT/DELETE /tp-groups/{id}/engine/serving``) and the routers'
read of them (``GET /instances``), against a real registry process over HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.app.api.conftest import Api, invalid, new_gid, problem

pytestmark = pytest.mark.api


def serve(api: httpx.Client, engine: dict[str, Any], url: str, **extra: Any) -> httpx.Response:
    body = {"engine_id": engine["engine_id"], "url": url, "model": "m", **extra}
    return api.put(f"/tp-groups/{engine['group_id']}/engine/serving", json=body)


def instances(api: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    resp = api.get("/instances", params={"limit": 10_000, **params})
    assert resp.status_code == 200, resp.text
    found: list[dict[str, Any]] = resp.json()["instances"]
    return found


def mine(found: list[dict[str, Any]], *gids: str) -> list[str]:
    return sorted(i["group_id"] for i in found if i["group_id"] in gids)


def test_a_ready_engine_that_published_its_url_is_an_instance_until_its_launch_ends(
    api: httpx.Client, reg: Api
) -> None:
    gid = new_gid("p")
    engine = reg.open(gid, role="prefill", compat={"block_size": 16})
    resp = serve(api, engine, "http://10.1.2.3:8000/", bootstrap="10.1.2.3:5600")
    assert resp.status_code == 200, resp.text
    serving = resp.json()["serving"]
    assert serving["url"] == "http://10.1.2.3:8000"  # the trailing slash is not kept
    assert serving["bootstrap"] == "10.1.2.3:5600"
    assert reg.engine(gid)["serving"]["model"] == "m"
    # Published but not ready (no rank registered): not offered.
    assert mine(instances(api), gid) == []
    reg.register_all(engine)
    [found] = [i for i in instances(api, role="prefill") if i["group_id"] == gid]
    assert found["engine_id"] == engine["engine_id"]
    assert found["url"] == "http://10.1.2.3:8000"
    assert found["compat"] == {"block_size": 16}
    assert mine(instances(api, role="decode"), gid) == []
    assert mine(instances(api, model="other"), gid) == []
    # A new launch supersedes the engine: what the old one published goes with it.
    relaunched = reg.open(gid, role="prefill")
    reg.register_all(relaunched)
    assert reg.engine(gid)["serving"] is None
    assert mine(instances(api), gid) == []
    # The old launch may not publish again; the new one may, and may withdraw.
    body = problem(serve(api, engine, "http://10.1.2.3:8000"), 409, "engine_id_mismatch")
    assert body["cause"] == "superseded"
    assert serve(api, relaunched, "http://10.1.2.4:8001").status_code == 200
    assert [i["url"] for i in instances(api) if i["group_id"] == gid] == ["http://10.1.2.4:8001"]
    gone = api.delete(
        f"/tp-groups/{gid}/engine/serving", params={"engine_id": relaunched["engine_id"]}
    )
    assert gone.status_code == 204, gone.text
    assert mine(instances(api), gid) == []


def test_an_engine_of_role_both_is_offered_as_either(api: httpx.Client, reg: Api) -> None:
    gid = new_gid("b")
    engine = reg.open(gid, role="both", tp_size=1)
    reg.register_all(engine)
    assert serve(api, engine, "http://10.1.2.5:8000").status_code == 200
    assert mine(instances(api, role="prefill"), gid) == [gid]
    assert mine(instances(api, role="decode"), gid) == [gid]


def test_instances_come_in_pages_of_one_snapshot(api: httpx.Client, reg: Api) -> None:
    model = f"paged-{new_gid()}"
    gids = [new_gid("pg") for _ in range(5)]
    for i, gid in enumerate(gids):
        engine = reg.open(gid, tp_size=1)
        reg.register_all(engine)
        assert serve(api, engine, f"http://10.2.0.{i + 1}:8000", model=model).status_code == 200
    seen: list[str] = []
    params: dict[str, Any] = {"model": model, "limit": 2}
    pages = 0
    while True:
        body = api.get("/instances", params=params).json()
        pages += 1
        seen += [i["group_id"] for i in body["instances"]]
        if body["continue"] is None:
            break
        params["continue"] = body["continue"]
    assert seen == sorted(gids)
    assert pages == 3
    # A token goes with its first page's filters.
    first = api.get("/instances", params={"model": model, "limit": 2}).json()
    invalid(api.get("/instances", params={"model": "x", "continue": first["continue"]}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("url", "10.0.0.1:8000"),  # no scheme
        ("url", "http://10.0.0.1"),  # no port
        ("url", "http://0.0.0.0:8000"),  # the wildcard a server binds, not an address
        ("url", "ftp://10.0.0.1:21"),
        ("bootstrap", "10.0.0.1"),
        ("bootstrap", "10.0.0.1:99999"),
        ("model", ""),
    ],
)
def test_a_serving_address_a_router_cannot_reach_is_refused(
    api: httpx.Client, reg: Api, field: str, value: str
) -> None:
    engine = reg.open(new_gid("bad"), tp_size=1)
    body = {"engine_id": engine["engine_id"], "url": "http://10.0.0.1:8000", "model": "m"}
    resp = api.put(f"/tp-groups/{engine['group_id']}/engine/serving", json={**body, field: value})
    errors = invalid(resp)
    assert any(e["loc"][-1] == field for e in errors), errors


def test_an_unknown_group_cannot_publish(api: httpx.Client) -> None:
    body = {"engine_id": "e", "url": "http://10.0.0.1:8000", "model": "m"}
    problem(api.put(f"/tp-groups/{new_gid()}/engine/serving", json=body), 404, "not_found")
