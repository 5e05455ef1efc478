"""A request naming a prefill engine the registry says is gone fails at once, with the cause.

A decode worker handshakes with a prefill engine the first time a request names it
(`kv_transfer_params.remote_engine_id`): vLLM dials the side channel the request names and
waits up to 5 s for an answer (`_nixl_handshake`). For an engine that was superseded (its group
relaunched) or that the registry never issued, that side channel is gone or serves another
engine. With the plugin active on a decode worker, the handshake first asks the registry
(`GET /engines/{id}`, a 1 s deadline): 410 or 404 fails the handshake at once, naming the
cause (vLLM then fails the request, or recomputes it under ``kv_load_failure_policy:
recompute``); any other answer, or none (registry unreachable), leaves the handshake to vLLM.
"""

from __future__ import annotations

import time
from typing import Any

from registry_client.errors import EngineSuperseded, NotFound, RegistryError
from workers.vllm_plugin import common
from workers.vllm_plugin.common import log
from workers.vllm_plugin.resolve import split_dp_suffix
from workers.vllm_plugin.settings import PluginSettings

CHECK_S = 1.0
MARK = "engine-registry: stale remote engine"
SIDE_CHANNEL_MARK = "engine-registry: handshake"


class StaleRemoteEngine(RuntimeError):
    """The registry says the request's prefill engine is superseded or unknown."""


def why_stale(exc: EngineSuperseded | NotFound, engine_id: str) -> str:
    """The log line and error of a refused handshake: which engine, why, what to do."""
    if isinstance(exc, EngineSuperseded):
        return (
            f"{MARK} {engine_id}: superseded by generation {exc.current_generation} (engine "
            f"{exc.current_engine_id}): its prefill group was relaunched; the request carries "
            "an old remote_engine_id (send it through the current prefill)"
        )
    return (
        f"{MARK} {engine_id}: unknown to the registry (never issued, or its group was "
        "deleted): the request names an engine of another registry or a deleted group"
    )


def verdict(client: Any, engine_id: str) -> str | None:
    """Why ``engine_id`` must not be handshaked with, or None (current, or no answer)."""
    base, _ = split_dp_suffix(engine_id)
    try:
        client.resolve_engine(base, timeout_s=CHECK_S)
    except (EngineSuperseded, NotFound) as exc:
        return why_stale(exc, engine_id)
    except RegistryError:
        return None  # no answer in time: vLLM's own handshake decides
    return None


def guard(worker: Any, settings: PluginSettings) -> bool:
    """Check each of ``worker``'s NIXL handshakes with the registry first; False when the
    worker has no ``_nixl_handshake`` (not vLLM's NIXL connector)."""
    handshake = getattr(worker, "_nixl_handshake", None)
    if handshake is None:
        return False

    def checked(
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        with common.client(settings, timeout_s=CHECK_S) as client:
            why = verdict(client, str(expected_engine_id))
        if why is not None:
            log.warning("%s (side channel %s:%s not dialed)", why, host, port)
            raise StaleRemoteEngine(why)
        t0 = time.perf_counter()
        result = handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs)
        log.info(
            "%s with engine %s over vLLM's side channel %s:%s in %.3f s",
            SIDE_CHANNEL_MARK,
            expected_engine_id,
            host,
            port,
            time.perf_counter() - t0,
        )
        return result

    worker._nixl_handshake = checked
    return True
