"""GET /tp-groups, DELETE /tp-groups/{id}, and resolving engine_ids with GET /engines/{id}."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.app.api.conftest import Api, invalid, launch, problem

pytestmark = pytest.mark.api


def test_list_groups_shows_the_current_engine_of_every_group(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    other = gid + "-b"
    reg.open(gid, tp_size=2)
    current = reg.open(gid, tp_size=2)
    reg.register(current, 0)
    single = reg.open(other, tp_size=1, role="decode")
    resp = api.get("/tp-groups")
    assert resp.status_code == 200, resp.text
    groups = {g["group_id"]: g for g in resp.json()["groups"]}
    assert groups[gid]["engine_id"] == current["engine_id"]
    assert groups[gid]["generation"] == 2
    assert groups[gid]["registered_ranks"] == [0]
    assert groups[gid]["missing_ranks"] == [1]
    assert groups[other]["engine_id"] == single["engine_id"]
    assert groups[other]["role"] == "decode"
    ids = [g["group_id"] for g in resp.json()["groups"]]
    assert len(ids) == len(set(ids))


def test_delete_group_answers_204_and_forgets_every_generation(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engines = [reg.open(gid, tp_size=2) for _ in range(3)]
    reg.register_all(engines[-1])
    resp = api.delete(f"/tp-groups/{gid}")
    assert resp.status_code == 204, resp.text
    assert resp.content == b""
    problem(api.get(f"/tp-groups/{gid}/engine"), 404, "not_found")
    for engine in engines:
        problem(api.get(f"/engines/{engine['engine_id']}"), 404, "not_found")
        hs = api.post(f"/engines/{engine['engine_id']}/handshake", json={"tp_size": 2, "rank": 0})
        problem(hs, 404, "not_found")
    assert gid not in {g["group_id"] for g in api.get("/tp-groups").json()["groups"]}


def test_delete_group_twice_or_unknown_is_404(api: httpx.Client, reg: Api, gid: str) -> None:
    reg.open(gid)
    assert api.delete(f"/tp-groups/{gid}").status_code == 204
    problem(api.delete(f"/tp-groups/{gid}"), 404, "not_found")
    problem(api.delete(f"/tp-groups/{gid}-never"), 404, "not_found")


def test_delete_group_with_an_invalid_id_is_422(api: httpx.Client) -> None:
    invalid(api.delete("/tp-groups/NOT-VALID"))


def test_groups_whose_ids_share_a_prefix_stay_apart(api: httpx.Client, reg: Api, gid: str) -> None:
    names = [gid, gid + "0", gid + ".x", gid + "-x"]
    engines = {name: reg.open(name, tp_size=2) for name in names}
    reg.register_all(engines[gid])
    for name in names[1:]:
        assert reg.engine(name)["registered_ranks"] == []
        assert reg.engine(name)["generation"] == 1
    assert api.delete(f"/tp-groups/{gid}").status_code == 204
    for name in names[1:]:
        resolved = api.get(f"/engines/{engines[name]['engine_id']}")
        assert resolved.status_code == 200, resolved.text
        assert reg.engine(name)["engine_id"] == engines[name]["engine_id"]


def test_a_recreated_group_starts_again_at_generation_one(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    first_launch = launch()
    old = [reg.open(gid, launch_id=first_launch), reg.open(gid)]
    assert api.delete(f"/tp-groups/{gid}").status_code == 204
    # Even the old launch_id is forgotten: it opens generation 1 of the new group.
    again = reg.open(gid, launch_id=first_launch, tp_size=4, expect=201)
    assert again["generation"] == 1
    assert again["tp_size"] == 4
    assert again["engine_id"] not in {e["engine_id"] for e in old}
    assert reg.open(gid)["generation"] == 2
    for engine in old:
        problem(api.get(f"/engines/{engine['engine_id']}"), 404, "not_found")


def test_deleting_one_group_leaves_the_others(api: httpx.Client, reg: Api, gid: str) -> None:
    keep = reg.open(gid + "-keep", tp_size=1)
    reg.register(keep, 0)
    reg.open(gid)
    assert api.delete(f"/tp-groups/{gid}").status_code == 204
    resolved = api.get(f"/engines/{keep['engine_id']}")
    assert resolved.status_code == 200
    assert resolved.json()["ready"] is True


def test_resolve_current_engine_id_answers_the_engine(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    engine = reg.open(gid, tp_size=2, compat={"model": "m"})
    reg.register(engine, 1)
    resp = api.get(f"/engines/{engine['engine_id']}")
    assert resp.status_code == 200, resp.text
    resolved = resp.json()
    assert resolved == reg.engine(gid)
    assert resolved["engine_id"] == engine["engine_id"]
    assert resolved["group_id"] == gid
    assert resolved["registered_ranks"] == [1]


def test_resolve_superseded_engine_id_is_410_with_the_current_engine(
    api: httpx.Client, reg: Api, gid: str
) -> None:
    first = reg.open(gid)
    second = reg.open(gid)
    third = reg.open(gid)
    for old in (first, second):
        body = problem(api.get(f"/engines/{old['engine_id']}"), 410, "engine_superseded")
        assert body["current_engine_id"] == third["engine_id"]
        assert body["current_generation"] == 3
        assert old["engine_id"] in body["detail"]


# Fixed ids (a fresh uuid each run): pytest-xdist's workers must collect the same names.
@pytest.mark.parametrize(
    "engine_id",
    [str(uuid.uuid4()), "not-a-uuid", "x" * 128],
    ids=["a-fresh-uuid", "not-a-uuid", "overlong"],
)
def test_resolve_never_issued_engine_id_is_404(api: httpx.Client, engine_id: str) -> None:
    problem(api.get(f"/engines/{engine_id}"), 404, "not_found")


def test_resolve_an_overlong_engine_id_is_422(api: httpx.Client) -> None:
    invalid(api.get(f"/engines/{'x' * 129}"))


def test_unknown_paths_and_methods_answer_problems(api: httpx.Client) -> None:
    problem(api.get("/no/such/path"), 404, "not_found")
    resp = api.post("/tp-groups")
    assert resp.status_code == 405
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert resp.json()["status"] == 405
