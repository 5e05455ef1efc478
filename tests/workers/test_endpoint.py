"""The NIXL endpoint (two real agents in one process, DRAM over UCX), the advertised host,
and the publication's heartbeat rules against scripted registry answers."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from registry_client.errors import TransferError
from registry_client.models import KvSpec, Target
from workers.endpoint import (
    NixlEndpoint,
    RemoteRead,
    advertise_host,
    check_host_for_group,
)
from workers.kv import KvLayout, fill, kv_spec, plan_reads, verify

pytestmark = pytest.mark.workers

LAYOUT = KvLayout(num_layers=1, num_blocks=4, block_size=4, num_heads=2, head_size=8)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_decode_agent_reads_verifies_and_notifies_a_prefill_agent_over_nixl() -> None:
    prefill = NixlEndpoint("unit-prefill-rank0")
    decode = NixlEndpoint("unit-decode-rank0")
    try:
        cache = LAYOUT.allocate(1, 4)
        fill(cache, "engine-x", LAYOUT, 1, 0)
        prefill.register(cache)
        buffer = LAYOUT.allocate(2, 2)
        decode.register(buffer)
        target = Target(0, prefill.name, prefill.metadata(), "127.0.0.1", kv_spec(cache, 2))
        assert decode.add_remote(target) == prefill.name
        (op,) = plan_reads(
            LAYOUT,
            local_tp=2,
            local_rank=1,
            local=kv_spec(buffer, 1),
            remote_tp=1,
            tp_ratio=2,
            targets={0: target.kv},
            local_block_ids=[0, 1],
            remote_block_ids=[3, 1],
        )
        decode.read(
            [RemoteRead(prefill.name, op.local, op.remote, "DRAM")],
            local_mem_type="DRAM",
            deadline_s=10,
        )
        assert verify(buffer, "engine-x", LAYOUT, 2, 1, [3, 1]) == op.nbytes
        decode.notify(prefill.name, b"verified")
        got: dict[str, list[bytes]] = {}
        assert wait_until(lambda: bool(got.update(prefill.notifications()) or got))
        assert got == {decode.name: [b"verified"]}
    finally:
        decode.close()
        prefill.close()
        decode.close()  # idempotent


def test_metadata_naming_another_agent_than_the_registry_is_refused() -> None:
    prefill = NixlEndpoint("unit-real-name")
    decode = NixlEndpoint("unit-reader")
    try:
        spec = KvSpec("DRAM", 0, [0], 1, 1)
        impostor = Target(0, "the-registered-name", prefill.metadata(), "127.0.0.1", spec)
        with pytest.raises(TransferError, match="registry says 'the-registered-name'"):
            decode.add_remote(impostor)
    finally:
        decode.close()
        prefill.close()


def test_a_read_from_an_unknown_agent_is_a_transfer_error() -> None:
    decode = NixlEndpoint("unit-lonely")
    buffer = torch.zeros(64, dtype=torch.int8)
    decode.register(buffer)
    try:
        with pytest.raises(TransferError):
            decode.read(
                [RemoteRead("nobody", [(buffer.data_ptr(), 8, 0)], [(4096, 8, 0)], "DRAM")],
                local_mem_type="DRAM",
                deadline_s=1,
            )
    finally:
        decode.close()


def test_the_advertised_host_is_the_one_routing_to_the_registry() -> None:
    assert advertise_host("http://127.0.0.1:8080") == "127.0.0.1"
    assert advertise_host("http://127.0.0.1:8080", "10.1.2.3") == "10.1.2.3"


def test_the_advertised_host_comes_from_the_environment_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKERS_ADVERTISE_HOST", "192.0.2.7")
    assert advertise_host("http://127.0.0.1:8080") == "192.0.2.7"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_an_unspecified_address_is_never_advertised(host: str) -> None:
    with pytest.raises(ValueError, match="unspecified"):
        advertise_host("http://127.0.0.1:8080", host)


def test_loopback_is_refused_when_the_group_spans_machines() -> None:
    check_host_for_group("127.0.0.1", ["node-a", "node-a"])
    check_host_for_group("10.0.0.1", ["node-a", "node-b"])
    with pytest.raises(ValueError, match="spans hosts"):
        check_host_for_group("127.0.0.1", ["node-a", "node-b"])
