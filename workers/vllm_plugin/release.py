"""A decode worker drops a prefill engine's NIXL state on the registry's word.

Each prefill engine a decode worker handshaked with is followed on the registry's watch stream
(`RegistryClient.watch`, one stream per worker, started at its first handshake). When the
engine's group is relaunched (a new engine supersedes it), deleted, or its ranks' leases lapse
(the engine is no longer ready: its process died or stalled past its lease), the worker hands
the engine to vLLM's own release: it forgets which side-channel address the engine serves
(`_engine_by_address`, under vLLM's `_handshake_lock`), so vLLM's next
`_cleanup_remote_engines` (its main thread, each engine step) sees the engine as replaced and
releases its agents and descriptor lists once no read is in flight. No restart, no NIXL call
from this thread. A request that names the engine afterwards handshakes again, and the
registry refuses a superseded one at once (`via_registry`, `stale`).

Without it, vLLM keeps a dead prefill's state until a new engine answers at the same address
or `engine_ttl` (3,600 s by default) passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.errors import RegistryUnavailable
from workers.models import Engine, Handshake
from workers.vllm_plugin import common
from workers.vllm_plugin.common import log
from workers.vllm_plugin.settings import PluginSettings

MARK = "engine-registry: releasing remote engine"
RETRY_S = 2.0  # a lost stream, or an engine whose handshake vLLM has not stored yet
RETRIES = 15


@dataclass(frozen=True)
class Followed:
    vllm_engine_id: str  # as vLLM keys it (with `_dp{rank}` under DP)
    engine_id: str  # the registry's
    group_id: str
    generation: int


def stale_cause(followed: Followed, engine: Engine | None) -> tuple[str, str] | None:
    """(kind, why) ``followed`` must be released, given its group's engine now (None: the
    group was deleted); None while it is current and ready."""
    if engine is None:
        return "deleted", f"its group {followed.group_id!r} was deleted"
    if engine.engine_id != followed.engine_id:
        return "superseded", (
            f"superseded by generation {engine.generation} (engine {engine.engine_id}): "
            f"group {followed.group_id!r} was relaunched"
        )
    if not engine.ready:
        return "not_ready", (
            f"ranks {engine.missing_ranks} of group {followed.group_id!r} have no live agent "
            "(their lease lapsed: the prefill died or stalled)"
        )
    return None


def hand_to_vllm(worker: Any, vllm_engine_id: str) -> bool:
    """Make vLLM's next `_cleanup_remote_engines` release ``vllm_engine_id``; False when vLLM
    holds no state for it (yet: its handshake may still be storing it)."""
    with worker._handshake_lock:
        if vllm_engine_id not in worker._remote_agents:
            return False
        for address, eid in list(worker._engine_by_address.items()):
            if eid == vllm_engine_id:
                del worker._engine_by_address[address]
    return True


class Follower:
    """The watch on the engines one decode worker loaded (its own daemon thread)."""

    def __init__(
        self,
        settings: PluginSettings,
        release: Callable[[str], bool],
        on_release: Callable[[Followed, str, str], None],
    ) -> None:
        self._settings = settings
        self._release = release
        self._on_release = on_release
        self._lock = threading.Lock()
        self._followed: dict[str, Followed] = {}  # by the registry's engine id
        self._groups: dict[str, Engine | None] = {}  # as the watch last said them
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def follow(self, vllm_engine_id: str, planned: Handshake) -> None:
        """Called once vLLM loaded ``planned``'s ranks (its handshake thread)."""
        followed = Followed(vllm_engine_id, planned.engine_id, planned.group_id, planned.generation)
        with self._lock:
            self._followed[planned.engine_id] = followed
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="engine-registry-release", daemon=True
                )
                self._thread.start()
            known = planned.group_id in self._groups
            engine = self._groups.get(planned.group_id)
        if known:
            self._check(followed, engine)

    def close(self) -> None:
        self._stop.set()

    def apply(self, kind: str, engines: list[Engine], deleted: bool = False) -> None:
        """One watch event: a SYNC's groups, or a group's change (``deleted``: it is gone)."""
        with self._lock:
            if kind == "SYNC":
                self._groups = {e.group_id: e for e in engines}
            for changed in engines:
                self._groups[changed.group_id] = None if deleted else changed
            todo = [
                (f, self._groups.get(f.group_id))
                for f in self._followed.values()
                if kind == "SYNC" or any(c.group_id == f.group_id for c in engines)
            ]
        for followed, engine in todo:
            self._check(followed, engine)

    def _check(self, followed: Followed, engine: Engine | None, tries: int = 0) -> None:
        verdict = stale_cause(followed, engine)
        if verdict is None:
            return
        kind, why = verdict
        if not self._release(followed.vllm_engine_id):
            if tries < RETRIES and not self._stop.is_set():
                timer = threading.Timer(RETRY_S, self._check, (followed, engine, tries + 1))
                timer.daemon = True
                timer.start()
            return
        with self._lock:
            self._followed.pop(followed.engine_id, None)
        log.warning(
            "%s %s (group %r, generation %d): %s; vLLM frees its NIXL state at its next "
            "engine step once no read is in flight",
            MARK, followed.vllm_engine_id, followed.group_id, followed.generation, why,
        )  # fmt: skip
        self._on_release(followed, kind, why)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with common.client(self._settings) as client:
                    for event in client.watch(idle_timeout_s=20.0, lost_after_s=30.0):
                        if event.type == "SYNC":
                            self.apply("SYNC", event.groups)
                        elif event.engine is not None:
                            self.apply(event.type, [event.engine], event.type == "DELETED")
                        if self._stop.is_set():
                            return
            except RegistryUnavailable as exc:
                log.warning("engine-registry: release watch lost (%s); retrying", exc)
            except Exception as exc:  # a refusal (token rotated) or a bad answer: said, retried
                log.error("engine-registry: release watch failed (%r); retrying", exc)
            self._stop.wait(RETRY_S)
