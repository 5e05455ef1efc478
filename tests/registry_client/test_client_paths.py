"""Ids in the client's URL paths (issue #39, item 4), against a real registry process and its
access log: an engine or group id outside the registry's grammar (``../admin/tokens``,
``x?y``, ``x#y``, a slash, a dot segment, a control or non-ASCII character) is refused by the
client before any request, so it never reaches another route; a decode worker handed such
a ``remote_engine_id`` refuses the handshake instead of falling back to the side channel."""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.server import RegistryProcess, free_port
from registry_client.client import RegistryClient
from registry_client.models import KvSpec
from registry_client.paths import (
    ENGINE_ID_PATTERN,
    GROUP_ID_PATTERN,
    InvalidId,
    check_path,
    engine_segment,
    group_segment,
)
from workers.vllm_plugin import common, via_registry
from workers.vllm_plugin.settings import PluginSettings

pytestmark = pytest.mark.api

HOSTILE_ENGINE_IDS = [
    "../../admin/tokens",
    "../../tp-groups/g/engine/agents/0/heartbeat",
    "x?next=/admin",
    "x#frag",
    "a/b",
    "..",
    ".",
    "%2e%2e",
    "e\n",
    "e 1",
    "é",
    "",
    "x" * 129,
]
HOSTILE_GROUP_IDS = ["../engines/x", "g?x=1", "g#x", "G", "g/", "..", "g\n", "-g", "g" * 65]
LOG_WAIT_S = 5.0


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("paths")
    with RegistryProcess(f"sqlite:///{d / 'r.db'}", log_path=d / "registry.log") as proc:
        yield proc


def logged_paths(registry: RegistryProcess, agent: str) -> list[str]:
    """The paths of the requests the access log shows from ``agent``, once the sentinel
    (``GET /healthz`` sent last) is there: everything sent before it is logged by then."""
    with RegistryClient(registry.url, user_agent=agent) as client:
        client.healthz()
    assert registry.log_path is not None
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        paths = []
        for line in registry.log_path.read_text(errors="replace").splitlines():
            try:
                entry: Any = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("user_agent") == agent:
                paths.append(str(entry.get("path")))
        if "/healthz" in paths or time.monotonic() > deadline:
            return paths
        time.sleep(0.05)


def engine_calls(client: RegistryClient, eid: str) -> list[Callable[[], object]]:
    return [
        functools.partial(client.handshake, eid, tp_size=1, rank=0),
        functools.partial(client.resolve_engine, eid),
    ]


def group_calls(client: RegistryClient, gid: str) -> list[Callable[[], object]]:
    kv = KvSpec("DRAM", 0, [4096], 8, 512)
    return [
        functools.partial(client.heartbeat, gid, 0, engine_id="e"),
        functools.partial(client.get_engine, gid),
        functools.partial(
            client.register_agent,
            gid,
            0,
            engine_id="e",
            agent_name="a",
            agent_metadata=b"x",
            host="10.0.0.1",
            kv=kv,
        ),
    ]


@pytest.mark.timeout(60)
def test_a_hostile_id_is_refused_before_any_request(registry: RegistryProcess) -> None:
    agent = f"paths-{uuid.uuid4().hex[:8]}"
    refused = 0
    with RegistryClient(registry.url, user_agent=agent, timeout_s=2.0) as client:
        for eid in HOSTILE_ENGINE_IDS:
            for call in engine_calls(client, eid):
                with pytest.raises(InvalidId, match="not an engine id of the registry"):
                    call()
                refused += 1
        for gid in HOSTILE_GROUP_IDS:
            for call in group_calls(client, gid):
                with pytest.raises(InvalidId, match="not a group id of the registry"):
                    call()
                refused += 1
        bad_rank: Any = True
        with pytest.raises(InvalidId, match="rank"):
            client.heartbeat("g", bad_rank, engine_id="e")
        with pytest.raises(InvalidId, match="would leave its route"):
            client.request("POST", "/tp-groups/g/../../admin/tokens")
    assert refused == 2 * len(HOSTILE_ENGINE_IDS) + 3 * len(HOSTILE_GROUP_IDS)
    assert logged_paths(registry, agent) == ["/healthz"], "a hostile id reached the registry"


def test_ids_of_the_grammar_pass_unchanged_and_the_grammar_is_the_registrys() -> None:
    from app.core import schemas

    assert ENGINE_ID_PATTERN == schemas.ENGINE_ID_PATTERN
    assert GROUP_ID_PATTERN == schemas.GROUP_ID_PATTERN
    uid = str(uuid.uuid4())
    assert engine_segment(uid) == uid
    assert engine_segment("e1") == "e1"
    assert group_segment("prefill-0.a_b") == "prefill-0.a_b"
    assert check_path(f"/engines/{uid}/handshake") == f"/engines/{uid}/handshake"


@contextlib.contextmanager
def zmq_ctx(*_args: Any) -> Iterator[Any]:
    """Where vLLM's module keeps its side-channel socket factory (`install` wraps it)."""
    raise AssertionError("the side channel's socket was opened")
    yield


class SideChannel:
    """vLLM's `_nixl_handshake` as far as this test needs: counts its dials."""

    def __init__(self) -> None:
        self.dials = 0

    def _nixl_handshake(self, *_args: Any, **_kwargs: Any) -> None:
        self.dials += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eid", ["../../admin/tokens", "x?y=1", "x#y", "a/b/c"])
def test_a_decode_refuses_a_hostile_remote_engine_id_and_dials_no_side_channel(
    registry: RegistryProcess, eid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = f"decode-{uuid.uuid4().hex[:8]}"
    with RegistryClient(registry.url) as client:
        decode, _ = client.open_engine(
            f"d-{uuid.uuid4().hex[:8]}", launch_id=uuid.uuid4().hex, tp_size=1, role="decode"
        )
    worker = SideChannel()
    settings = PluginSettings(url=registry.url, group=decode.group_id)
    side = via_registry.DecodeSide(1, 0, {}, decode.group_id, decode.engine_id)
    assert via_registry.install(worker, settings, side)
    monkeypatch.setattr(common, "user_agent", lambda _settings: agent)
    with pytest.raises(via_registry.RegistryHandshakeError, match="not asked"):
        worker._nixl_handshake("127.0.0.1", free_port(), 1, eid)
    assert worker.dials == 0, "the side channel was dialed"
    assert logged_paths(registry, agent) == ["/healthz"]
