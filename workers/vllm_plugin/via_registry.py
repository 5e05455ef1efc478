"""Handshakes through the registry: a decode worker loads a prefill engine's ranks from the
registry's answer instead of dialing the prefill's NIXL side channel.

vLLM's `_nixl_handshake` (decode worker, a background thread) opens a ZMQ REQ socket to the
prefill's side channel and, for each remote rank it must read from, sends
``(GET_META_MSG, pp_rank, tp_rank)`` and receives ``[payload, perf_counter]``: the rank's
`NixlHandshakePayload` (msgpack) and the prefill scheduler's clock, from which it estimates the
clock offset its block-expiry checks use. Then it checks the compatibility hash, the parallel
config and the engine id, and adds the remote agent.

Here the plugin asks the registry first (`POST /engines/{id}/handshake`, naming this decode's
group and engine), and runs vLLM's own `_nixl_handshake` with a socket that answers those same
queries from the registry's answer, with no network. Every check vLLM makes runs, in vLLM's
code. What the side channel also gave, the clock, comes from what the prefill ranks published:
node 0's ``time.perf_counter() - time.time()`` (broadcast from rank 0 at start, node 0 being
where vLLM's scheduler stamps block expiry), so the offset is that minus this node's, exact on
one host and as good as the nodes' wall clocks agree (NTP) across hosts.

Stale engines are refused as in `stale` (410/404 from the same call); a registry that does not
answer (no replica reachable, its store down, TLS refused) leaves the handshake to the side
channel (logged), so the registry is never the only way in. Any other answer is a refusal,
never a reason to dial: a remote engine id outside the registry's grammar (it comes from the
request's ``kv_transfer_params``) is refused before any request. A prefill whose ranks did
not publish the payload (an older plugin, or no NIXL connector) is handshaked over its side
channel too, said in the log.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from registry_client.errors import (
    EngineSuperseded,
    Forbidden,
    Incompatible,
    InvalidRequest,
    NotFound,
    NotReady,
    RegistryError,
    RegistryUnavailable,
    StoreUnavailable,
    Unauthorized,
)
from registry_client.models import Handshake
from registry_client.paths import InvalidId
from registry_client.tls import RegistryTLSError
from workers.vllm_plugin import common, stale
from workers.vllm_plugin.common import log
from workers.vllm_plugin.payload_bounds import PayloadOutOfBounds, check_payload
from workers.vllm_plugin.resolve import split_dp_suffix
from workers.vllm_plugin.settings import PluginSettings

BLOB_FORMAT = "vllm-nixl-handshake-payload"  # kv["blob"]: the agent blob is that payload
MARK = "engine-registry: handshake"
HANDSHAKE_S = 5.0  # the registry's deadline: vLLM's own side channel waits 5 s per rank


class RegistryHandshakeError(RuntimeError):
    """The registry's answer cannot stand in for the side channel (the cause is said)."""


def clock_reference() -> float:
    """This host's monotonic clock (vLLM's perf_counter on Linux) minus its wall clock."""
    return time.perf_counter() - time.time()


@dataclass(frozen=True)
class Answer:
    """What the side channel would have served: each (pp, tp) rank's payload, and the
    offset of the prefill scheduler's perf_counter to this process's."""

    payloads: dict[tuple[int, int], bytes]
    clock_offset: float


class PayloadRefused(RegistryHandshakeError):
    """A published payload whose sizes a decode must not take (`payload_bounds`): refused,
    never retried over the side channel (which would serve the same payload)."""


def answer_of(
    handshake: Handshake, local_clock: float, local_block_size: int | None = None
) -> Answer:
    """The side channel's replies from the registry's handshake answer, or why not."""
    payloads: dict[tuple[int, int], bytes] = {}
    clocks: set[float] = set()
    for target in handshake.targets:
        extra = target.kv.extra
        if extra.get("blob") != BLOB_FORMAT:
            raise RegistryHandshakeError(
                f"rank {target.rank} of engine {handshake.engine_id} published no vLLM "
                "handshake payload (a prefill without this plugin's NIXL publication)"
            )
        try:
            check_payload(target.agent_metadata, target.kv, local_block_size)
        except PayloadOutOfBounds as exc:
            raise PayloadRefused(
                f"{MARK}: rank {target.rank} of engine {handshake.engine_id} published a "
                f"payload out of bounds, not loaded: {exc}"
            ) from None
        clock = extra.get("scheduler_clock")
        if not isinstance(clock, int | float):
            raise RegistryHandshakeError(
                f"rank {target.rank} of engine {handshake.engine_id} published no clock "
                "reference (scheduler_clock)"
            )
        clocks.add(float(clock))
        payloads[(0, target.rank)] = target.agent_metadata
    if len(clocks) != 1:
        raise RegistryHandshakeError(
            f"the ranks of engine {handshake.engine_id} published different clock "
            f"references {sorted(clocks)}: they were not broadcast from rank 0"
        )
    return Answer(payloads, clocks.pop() - local_clock)


class RegistrySocket:
    """Stands where vLLM's REQ socket to the side channel would, for one handshake: answers
    ``(GET_META_MSG, pp_rank, tp_rank)`` with that rank's payload and the prefill
    scheduler's clock now (this process's perf_counter plus the offset)."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._next: bytes | None = None

    def setsockopt(self, *_args: Any) -> None:
        """Socket options (vLLM's receive timeout) mean nothing here: nothing waits."""

    def send(self, message: bytes, *_args: Any, **_kwargs: Any) -> None:
        _msg, pp_rank, tp_rank = msgpack.unpackb(message)
        payload = self._answer.payloads.get((int(pp_rank), int(tp_rank)))
        if payload is None:
            raise RegistryHandshakeError(
                f"vLLM asked for pp rank {pp_rank}, tp rank {tp_rank}, which the registry's "
                f"plan does not include (it planned {sorted(self._answer.payloads)})"
            )
        self._next = payload

    def recv_multipart(self, *_args: Any, **_kwargs: Any) -> list[bytes]:
        if self._next is None:
            raise RegistryHandshakeError("vLLM read a reply before asking (protocol changed?)")
        payload, self._next = self._next, None
        return [payload, msgpack.packb(time.perf_counter() + self._answer.clock_offset)]


_serving = threading.local()  # the Answer of the handshake running on this thread, if any


def route_side_channel(module: Any) -> bool:
    """Make ``module.zmq_ctx`` (vLLM's base_worker) yield a `RegistrySocket` on a thread that
    runs a registry handshake, and the real socket everywhere else. False when the module
    has no ``zmq_ctx`` (another vLLM: the side channel is used)."""
    original = getattr(module, "zmq_ctx", None)
    if original is None:
        return False
    if getattr(original, "_engine_registry", False):
        return True

    @contextlib.contextmanager
    def zmq_ctx(*args: Any, **kwargs: Any) -> Iterator[Any]:
        answer: Answer | None = getattr(_serving, "answer", None)
        if answer is None:
            with original(*args, **kwargs) as sock:
                yield sock
        else:
            yield RegistrySocket(answer)

    zmq_ctx._engine_registry = True  # type: ignore[attr-defined]
    module.zmq_ctx = zmq_ctx
    return True


@dataclass(frozen=True)
class DecodeSide:
    """Who asks: this decode worker's TP size, rank, compat, group and engine."""

    tp_size: int
    rank: int
    compat: dict[str, Any]
    group_id: str
    engine_id: str


def install(
    worker: Any,
    settings: PluginSettings,
    side: DecodeSide,
    *,
    on_handshake: Callable[[str, Handshake], None] | None = None,
    on_side_channel: Callable[[], None] | None = None,
) -> bool:
    """Handshake ``worker``'s remote engines through the registry; False when this vLLM's
    worker has no ``_nixl_handshake`` or its module no ``zmq_ctx``."""
    handshake = getattr(worker, "_nixl_handshake", None)
    if handshake is None:
        return False
    # The module that defines vLLM's `_nixl_handshake` (base_worker) holds its `zmq_ctx`.
    module = sys.modules.get(getattr(handshake, "__module__", "") or "")
    if module is None or not route_side_channel(module):
        log.warning("%s: this vLLM has no zmq_ctx in %s: side channel used", MARK, module)
        return False

    def side_channel(host: str, port: int, why: str, *args: Any, **kwargs: Any) -> Any:
        log.warning("%s: %s; over vLLM's side channel %s:%s instead", MARK, why, host, port)
        if on_side_channel is not None:
            on_side_channel()
        return handshake(host, port, *args, **kwargs)

    def via_registry(
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        rest = (remote_tp_size, expected_engine_id, remote_dcp_size, remote_pp_size, *args)
        if remote_pp_size != 1 or remote_dcp_size != 1:
            why = f"remote PP {remote_pp_size} / DCP {remote_dcp_size} is not planned by it"
            return side_channel(host, port, why, *rest, **kwargs)
        base, _ = split_dp_suffix(str(expected_engine_id))
        decode_engine, _ = split_dp_suffix(side.engine_id)  # the registry's id, checked there
        t0 = time.perf_counter()
        try:
            with common.client(settings, timeout_s=HANDSHAKE_S) as client:
                planned = client.handshake(
                    base,
                    tp_size=side.tp_size,
                    rank=side.rank,
                    compat=side.compat,
                    decode={"group_id": side.group_id, "engine_id": decode_engine},
                    timeout_s=HANDSHAKE_S,
                )
        except NotFound as exc:
            if exc.problem.get("decode_group_id"):  # this decode's own group, not the prefill
                raise RegistryHandshakeError(f"{MARK} refused by the registry: {exc}") from exc
            why = stale.why_stale(exc, str(expected_engine_id))
            log.warning("%s (side channel %s:%s not dialed)", why, host, port)
            raise stale.StaleRemoteEngine(why) from exc
        except EngineSuperseded as exc:
            why = stale.why_stale(exc, str(expected_engine_id))
            log.warning("%s (side channel %s:%s not dialed)", why, host, port)
            raise stale.StaleRemoteEngine(why) from exc
        except (Incompatible, NotReady, InvalidRequest, Unauthorized, Forbidden) as exc:
            # The registry answered, and no side channel would do better: the prefill's
            # ranks are not live, or the pair cannot work, or this token may not ask.
            raise RegistryHandshakeError(f"{MARK} refused by the registry: {exc}") from exc
        except InvalidId as exc:  # from the request's kv_transfer_params: not a registry id
            raise RegistryHandshakeError(f"{MARK} not asked: {exc}") from exc
        except (RegistryUnavailable, StoreUnavailable, RegistryTLSError) as exc:
            return side_channel(host, port, f"the registry did not answer ({exc})", *rest, **kwargs)
        except RegistryError as exc:  # it answered, and not with the contract's handshake
            raise RegistryHandshakeError(f"{MARK} refused by the registry: {exc}") from exc
        if planned.remote_tp_size != remote_tp_size:
            raise RegistryHandshakeError(
                f"{MARK}: the request says engine {expected_engine_id} has TP "
                f"{remote_tp_size}, the registry says {planned.remote_tp_size}"
            )
        block_size = side.compat.get("block_size")
        local_block_size = block_size if isinstance(block_size, int) else None
        try:
            answer = answer_of(planned, clock_reference(), local_block_size)
        except PayloadRefused:
            raise
        except RegistryHandshakeError as exc:
            return side_channel(host, port, str(exc), *rest, **kwargs)
        _serving.answer = answer
        try:
            result = handshake(host, port, *rest, **kwargs)
        finally:
            _serving.answer = None
        log.info(
            "%s with engine %s (group %r, generation %d): ranks %s loaded from the registry "
            "in %.3f s, clock offset %.6f s; side channel %s:%s not dialed",
            MARK,
            expected_engine_id,
            planned.group_id,
            planned.generation,
            [t.rank for t in planned.targets],
            time.perf_counter() - t0,
            answer.clock_offset,
            host,
            port,
        )
        if on_handshake is not None:
            on_handshake(str(expected_engine_id), planned)
        return result

    worker._nixl_handshake = via_registry
    return True
