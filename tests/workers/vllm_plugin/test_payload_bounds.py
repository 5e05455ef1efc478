"""What a decode takes from a published handshake payload is bounded (issue #39, item 7),
against a real registry process. A prefill rank publishes a payload in vLLM's format
(``NixlHandshakePayload`` around ``NixlAgentMetadata``, msgpack maps as msgspec writes them)
whose numbers would size the decode's descriptor lists: ``num_blocks`` of 2**40, a
``region_num_blocks`` summing past the limit, more regions than it registered. The decode
refuses the handshake before vLLM sees the payload, and dials no side channel (which would
serve the same payload). The registry refuses a KV description whose sizes are absurd."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest

from harness.server import RegistryProcess, free_port
from registry_client.client import RegistryClient
from registry_client.models import KvSpec
from workers.vllm_plugin import payload_bounds, via_registry
from workers.vllm_plugin.settings import PluginSettings

pytestmark = [pytest.mark.faults, pytest.mark.timeout(60)]

ADDRS = [1 << 20, 2 << 20]
NUM_BLOCKS = 64
BLOCK_LEN = 4096


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("bounds")
    with RegistryProcess(f"sqlite:///{d / 'r.db'}", log_path=d / "registry.log") as proc:
        yield proc


def payload(**meta: Any) -> bytes:
    """A payload as vLLM's side channel serves it, with ``meta`` over sane defaults."""
    fields: dict[str, Any] = {
        "engine_id": "prefill",
        "agent_metadata": b"nixl",
        "kv_caches_base_addr": ADDRS,
        "device_id": 0,
        "num_blocks": NUM_BLOCKS,
        "block_lens": [BLOCK_LEN] * len(ADDRS),
        "block_strides": [BLOCK_LEN] * len(ADDRS),
        "kv_cache_layout": "HND",
        "block_size": 16,
        "ssm_sizes": [0, 0],
        "attn_backend_name": "TORCH_SDPA",
        "physical_blocks_per_logical_kv_block": 1,
        "region_num_blocks": [NUM_BLOCKS] * len(ADDRS),
        **meta,
    }
    inner = msgpack.packb(fields)
    return bytes(msgpack.packb({"compatibility_hash": "h", "agent_metadata_bytes": inner}))


def publish(client: RegistryClient, blob: bytes) -> str:
    group = f"p-{uuid.uuid4().hex[:8]}"
    engine, _ = client.open_engine(
        group, launch_id=uuid.uuid4().hex, tp_size=1, role="prefill", compat={"block_size": 16}
    )
    extra = {"blob": via_registry.BLOB_FORMAT, "scheduler_clock": 0.0}
    kv = KvSpec("DRAM", 0, ADDRS, NUM_BLOCKS, BLOCK_LEN, extra=extra)
    client.register_agent(
        group,
        0,
        engine_id=engine.engine_id,
        agent_name="prefill-rank0",
        agent_metadata=blob,
        host="127.0.0.1",
        kv=kv,
    )
    return engine.engine_id


@contextlib.contextmanager
def zmq_ctx(*_args: Any) -> Iterator[Any]:
    """vLLM's socket factory: outside a registry handshake it would dial; here it fails."""
    raise AssertionError("the side channel was dialed")
    yield


class Worker:
    """vLLM's `_nixl_handshake`: asks this module's `zmq_ctx` for rank 0's payload."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []

    def _nixl_handshake(self, host: str, port: int, *_rest: Any) -> None:
        with zmq_ctx(None, f"tcp://{host}:{port}") as sock:
            sock.send(msgpack.packb((b"get_meta_msg", 0, 0)))
            self.loaded.append(sock.recv_multipart()[0])


def handshake(registry: RegistryProcess, prefill: str, dp_suffix: str = "") -> Worker:
    with RegistryClient(registry.url) as client:
        decode, _ = client.open_engine(
            f"d-{uuid.uuid4().hex[:8]}", launch_id=uuid.uuid4().hex, tp_size=1, role="decode"
        )
    worker = Worker()
    engine_id = decode.engine_id + dp_suffix  # vLLM's id of a data-parallel rank
    side = via_registry.DecodeSide(1, 0, {"block_size": 16}, decode.group_id, engine_id)
    settings = PluginSettings(url=registry.url, group=decode.group_id)
    assert via_registry.install(worker, settings, side)
    worker._nixl_handshake("127.0.0.1", free_port(), 1, prefill)
    return worker


def test_a_sane_payload_reaches_vllm(registry: RegistryProcess) -> None:
    blob = payload()
    with RegistryClient(registry.url) as client:
        prefill = publish(client, blob)
    assert handshake(registry, prefill).loaded == [blob]
    # A data-parallel decode names its registry engine (vLLM's "_dp<N>" suffix dropped).
    assert handshake(registry, prefill, "_dp3").loaded == [blob]


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"num_blocks": 2**40}, "num_blocks"),
        ({"num_blocks": NUM_BLOCKS + 1}, "differs from the registered kv.num_blocks"),
        ({"region_num_blocks": [2**40, 1]}, "region_num_blocks"),
        ({"region_num_blocks": [NUM_BLOCKS] * 3}, "region_num_blocks"),
        ({"kv_caches_base_addr": [1 << 20] * 5000}, "kv_caches_base_addr"),
        ({"kv_caches_base_addr": [*ADDRS, 3 << 20]}, "differs from the registered"),
        ({"block_lens": [2**40, 2**40]}, "block_lens"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 1}, "ratio 16"),
        ({"physical_blocks_per_logical_kv_block": -1}, "physical_blocks_per_logical"),
        ({"region_names": ["x"] * 100}, "region_names"),
        ({"num_blocks": True}, "num_blocks"),
    ],
)
def test_a_payload_out_of_bounds_is_refused_before_vllm_sees_it(
    registry: RegistryProcess, meta: dict[str, Any], why: str
) -> None:
    if why == "ratio 16":  # 16x the descriptors only past the limit
        meta = {**meta, "region_num_blocks": [2**23, 2**23]}
    with RegistryClient(registry.url) as client:
        prefill = publish(client, payload(**meta))
    with pytest.raises(via_registry.PayloadRefused, match=why):
        handshake(registry, prefill)


def test_a_payload_that_is_not_msgpack_is_refused() -> None:
    kv = KvSpec("DRAM", 0, ADDRS, NUM_BLOCKS, BLOCK_LEN)
    bad = msgpack.packb({"agent_metadata_bytes": b"\xc1"})
    with pytest.raises(payload_bounds.PayloadOutOfBounds, match="not msgpack"):
        payload_bounds.check_payload(bad, kv)


@pytest.mark.parametrize(
    "kv",
    [
        {"num_blocks": 2**24 + 1},
        {"block_len": 2**32 + 1},
        {"base_addrs": [4096] * 4097},
        {"base_addrs": [4096] * 16, "num_blocks": 2**24},  # 2**28 descriptors
        {"num_blocks": 2**24, "block_len": 2**21},  # a 32 TiB region
        {"device_id": 65536},
    ],
)
def test_the_registry_refuses_an_absurd_kv_description(
    registry: RegistryProcess, kv: dict[str, Any]
) -> None:
    with httpx.Client(base_url=registry.url, timeout=10.0) as http:
        group = f"k-{uuid.uuid4().hex[:8]}"
        body = {"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": "prefill"}
        eid = http.put(f"/tp-groups/{group}/engine", json=body).json()["engine_id"]
        description = {
            "mem_type": "DRAM",
            "device_id": 0,
            "base_addrs": [4096],
            "num_blocks": 8,
            "block_len": 4096,
            **kv,
        }
        agent = {
            "engine_id": eid,
            "agent_name": "a",
            "agent_metadata": "bml4bA==",
            "host": "127.0.0.1",
            "kv": description,
        }
        resp = http.put(f"/tp-groups/{group}/engine/agents/0", json=agent)
        assert resp.status_code == 422, resp.text
        assert resp.json()["code"] == "invalid_request"
        assert http.get(f"/tp-groups/{group}/engine").json()["registered_ranks"] == []


def test_the_plugins_limits_are_the_registrys() -> None:
    from app.core import schemas

    for name in ("MAX_KV_REGIONS", "MAX_NUM_BLOCKS", "MAX_BLOCK_LEN", "MAX_KV_DESCRIPTORS"):
        assert getattr(payload_bounds, name) == getattr(schemas, name), name
