from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.core.schemas import HandshakeRequest, OpenEngineRequest, RegisterAgentRequest

pytestmark = pytest.mark.unit

KV = {"mem_type": "DRAM", "device_id": 0, "base_addrs": [4096], "num_blocks": 8, "block_len": 64}


def agent(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "engine_id": "e",
        "agent_name": "a",
        "agent_metadata": "aGVsbG8=",
        "host": "10.0.0.2",
        "kv": KV,
    }
    body.update(overrides)
    return body


def test_agent_ttl_defaults_to_thirty_seconds() -> None:
    assert RegisterAgentRequest.model_validate(agent()).ttl_s == 30


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "not a host", "1.2.3.4.5", ""])
def test_unspecified_or_malformed_hosts_are_refused(host: str) -> None:
    with pytest.raises(ValidationError):
        RegisterAgentRequest.model_validate(agent(host=host))


@pytest.mark.parametrize("host", ["10.0.0.2", "fe80::1", "node-1.cluster.local", "127.0.0.1"])
def test_addresses_and_dns_names_are_accepted(host: str) -> None:
    assert RegisterAgentRequest.model_validate(agent(host=host)).host == host


@pytest.mark.parametrize("blob", ["not base64!", "aGVsbG8", "aGVs\nbG8="])
def test_blob_must_be_strict_base64(blob: str) -> None:
    with pytest.raises(ValidationError, match="base64"):
        RegisterAgentRequest.model_validate(agent(agent_metadata=blob))


@pytest.mark.parametrize("ttl", [4, 3601, 30.0, "30"])
def test_ttl_outside_5_to_3600_or_not_an_integer_is_refused(ttl: object) -> None:
    with pytest.raises(ValidationError):
        RegisterAgentRequest.model_validate(agent(ttl_s=ttl))


def test_kv_keeps_extra_layout_keys() -> None:
    req = RegisterAgentRequest.model_validate(agent(kv={**KV, "kv_layout": "HND"}))
    assert req.kv.model_dump()["kv_layout"] == "HND"


@pytest.mark.parametrize(
    "compat",
    [
        {"nested": {"a": 1}},
        {"none": None},
        {f"k{i}": i for i in range(33)},
        {"list": [1]},
        {"": 1},
    ],
)
def test_compat_must_be_flat_scalars_with_at_most_32_keys(compat: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        OpenEngineRequest.model_validate(
            {"launch_id": "l", "tp_size": 2, "role": "prefill", "compat": compat}
        )


def test_compat_keeps_json_types_apart() -> None:
    req = OpenEngineRequest.model_validate(
        {"launch_id": "l", "tp_size": 2, "role": "both", "compat": {"a": True, "b": 1, "c": "1"}}
    )
    assert req.compat == {"a": True, "b": 1, "c": "1"}
    assert type(req.compat["a"]) is bool
    assert type(req.compat["b"]) is int


@pytest.mark.parametrize("tp", ["4", 4.5, True, 0, -1])
def test_tp_size_must_be_a_positive_integer(tp: object) -> None:
    with pytest.raises(ValidationError):
        OpenEngineRequest.model_validate({"launch_id": "l", "tp_size": tp, "role": "prefill"})


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        OpenEngineRequest.model_validate(
            {"launch_id": "l", "tp_size": 2, "role": "prefill", "tp": 2}
        )


def test_handshake_rank_must_be_below_its_tp_size() -> None:
    with pytest.raises(ValidationError, match="below tp_size"):
        HandshakeRequest.model_validate({"tp_size": 2, "rank": 2})
