"""A decode worker's use of the registry: handshakes through it (`via_registry`), prefill
engines followed and released on its word (`release`), counted (`metrics`).

Active on a worker whose instance may decode (role decode or both) when
``ENGINE_REGISTRY_HANDSHAKE`` is ``registry`` (the default) and ``ENGINE_REGISTRY_CHECK_REMOTE``
is true; otherwise `stale.guard` alone (``side-channel``) or nothing (check off) applies.
"""

from __future__ import annotations

from typing import Any

from registry_client.models import Handshake
from workers.vllm_plugin import release, via_registry
from workers.vllm_plugin.common import log
from workers.vllm_plugin.metrics import WorkerCounters
from workers.vllm_plugin.settings import PluginSettings


def attach_decode_side(
    worker: Any, settings: PluginSettings, side: via_registry.DecodeSide
) -> bool:
    """Install the registry handshake and the release follower on ``worker``; False when
    the settings ask for vLLM's side channel or this vLLM lacks the hook points."""
    if settings.handshake != "registry" or not settings.check_remote:
        return False
    needed = ("_handshake_lock", "_remote_agents", "_engine_by_address", "_cleanup_remote_engine")
    missing = [name for name in needed if not hasattr(worker, name)]
    if missing:
        log.warning(
            "%s: this vLLM's NIXL worker lacks %s: side channel used",
            via_registry.MARK,
            ", ".join(missing),
        )
        return False
    counters = WorkerCounters()

    def held() -> int:
        return len(worker._remote_agents)

    def on_release(followed: release.Followed, kind: str, _why: str) -> None:
        counters.released(kind)

    # One watch a node, of the groups serving this instance's model (`node_follow`): not
    # `role=prefill`, which is exact and would miss the `both` engines a decode loads too.
    model = side.compat.get("model")
    follower = release.Follower(
        settings,
        lambda eid: release.hand_to_vllm(worker, eid),
        on_release,
        model=str(model) if model else None,
    )

    said: list[BaseException] = []

    def on_handshake(vllm_engine_id: str, planned: Handshake) -> None:
        # vLLM has loaded the ranks: following them for release is extra, never a reason to
        # fail the handshake (said once per worker).
        try:
            follower.follow(vllm_engine_id, planned)
        except Exception as exc:
            if not said:
                said.append(exc)
                log.error(
                    "engine-registry: cannot follow remote engines for release (%r); vLLM "
                    "keeps them until engine_ttl, handshakes go on",
                    exc,
                )
        counters.handshake("registry", held() + (vllm_engine_id not in worker._remote_agents))

    def on_side_channel() -> None:
        counters.handshake("side_channel", held())

    if not via_registry.install(
        worker, settings, side, on_handshake=on_handshake, on_side_channel=on_side_channel
    ):
        return False
    cleanup = worker._cleanup_remote_engine

    def cleanup_and_count(engine_id: str, *args: Any, **kwargs: Any) -> Any:
        result = cleanup(engine_id, *args, **kwargs)
        counters.freed(held())
        log.info(
            "engine-registry: vLLM freed the NIXL state of remote engine %s; %d held",
            engine_id,
            held(),
        )
        return result

    worker._cleanup_remote_engine = cleanup_and_count
    worker._engine_registry_follower = follower
    return True
