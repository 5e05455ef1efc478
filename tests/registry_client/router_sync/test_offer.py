"""What `engine-registry router-sync` offers routers (`registry_client.router_sync.sync.offer`),
from engines as
the registry's watch gives them: the pairing rules without a process."""

from __future__ import annotations

from typing import Any

import pytest

from registry_client.models import Engine
from registry_client.router_sync.offers import offer

pytestmark = pytest.mark.unit
COMPAT = {"model": "tiny", "block_size": 16}


def engine(
    gid: str,
    role: str,
    port: int,
    *,
    ready: bool = True,
    model: str = "tiny",
    url: str | None = None,
    created: str = "2026-12-01T00:00:00Z",
    **compat: Any,
) -> Engine:
    return Engine.from_json(
        {
            "group_id": gid,
            "engine_id": f"e-{gid}",
            "generation": 1,
            "tp_size": 1,
            "role": role,
            "compat": {**COMPAT, **compat},
            "ready": ready,
            "registered_ranks": [0] if ready else [],
            "missing_ranks": [] if ready else [0],
            "created_at": created,
            "serving": {
                "url": url or f"http://10.0.0.1:{port}",
                "model": model,
                "bootstrap": None,
                "published_at": created,
            },
        }
    )


def offered(engines: list[Engine], model: str | None = None) -> list[tuple[str, str]]:
    return sorted((o.group_id, o.kind) for o in offer(engines, model)[0])


def test_ready_compatible_pairs_are_offered_and_the_rest_say_why() -> None:
    engines = [
        engine("d0", "decode", 1, created="2026-12-01T00:00:00Z"),
        engine("d1", "decode", 2, created="2026-12-01T00:00:01Z", block_size=32),
        engine("p0", "prefill", 3),
        engine("p1", "prefill", 4, block_size=32),
        engine("p2", "prefill", 5, ready=False),
        engine("p3", "prefill", 6, url="https://10.0.0.1:7"),
        engine("p4", "prefill", 8, model="other"),
        engine("b0", "both", 9, created="2026-12-01T00:00:02Z"),
    ]
    got, why = offer(engines)
    assert sorted((o.group_id, o.kind) for o in got) == [
        ("b0", "D"),
        ("b0", "P"),
        ("d0", "D"),
        ("p0", "P"),
    ]
    assert why["d1"].startswith("incompatible: block_size 32 vs 16 of d0")
    assert why["p1"].startswith("incompatible: block_size 32 vs 16 of d0")
    assert why["p2"] == "not ready (missing ranks [0])"
    assert "not http://host:port" in why["p3"]
    assert why["p4"] == "serves model 'other', not 'tiny'"
    [p0] = [o for o in got if o.group_id == "p0"]
    assert p0.message() == {"type": "P", "http_address": "10.0.0.1:3", "zmq_address": "10.0.0.1:3"}


def test_no_prefill_is_offered_without_a_decode_to_pair_with() -> None:
    got, why = offer([engine("p0", "prefill", 3)])
    assert got == []
    assert why["p0"] == "no decode instance to pair with"


def test_the_model_flag_picks_the_instances() -> None:
    engines = [
        engine("d0", "decode", 1),
        engine("d1", "decode", 2, model="big"),
        engine("p1", "prefill", 3, model="big"),
    ]
    assert offered(engines) == [("d0", "D")]
    assert offered(engines, "big") == [("d1", "D"), ("p1", "P")]


def test_engines_that_never_published_are_not_mentioned() -> None:
    silent = Engine.from_json(
        {
            "group_id": "x",
            "engine_id": "e",
            "generation": 1,
            "tp_size": 1,
            "role": "decode",
            "ready": True,
        }
    )
    assert offer([silent]) == ([], {})
