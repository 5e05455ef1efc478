"""A decode worker drops a prefill engine's NIXL state on the registry's word.

Each prefill engine a decode worker handshaked with is followed on the registry's watch
stream: one stream a node, shared by the node's decode workers (`node_follow`, started at a
worker's first handshake) and filtered by the instance's model. When the engine's group is
relaunched (a new engine supersedes it), deleted, or its ranks' leases lapse (the engine is
no longer ready: its process died or stalled past its lease), the worker hands
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry_client.backoff import Backoff
from registry_client.models import Engine, Handshake
from workers.vllm_plugin.common import log
from workers.vllm_plugin.node_follow import NodeFeed
from workers.vllm_plugin.settings import PluginSettings

MARK = "engine-registry: releasing remote engine"
# An engine whose handshake vLLM has not stored yet: tried again (pauses of 0.1 s doubling
# to 2 s, jittered) for this long.
RETRY_FOR_S = 30.0
RETRY_BASE_S, RETRY_CAP_S = 0.1, 2.0
# A handshake can read an engine newer than what the watch has said yet (the watch lags by
# a few ms): an engine followed less than this long ago is not released as deleted or not
# ready until then (judged on the watch's word at that time), and a word about an older
# generation than the handshake's is the watch catching up, never a verdict.
SETTLE_S = 2.0


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
    """The engines one decode worker loaded, released on its node's watch (`node_follow`):
    one daemon thread for the node's events, one for the releases vLLM was not ready for."""

    def __init__(
        self,
        settings: PluginSettings,
        release: Callable[[str], bool],
        on_release: Callable[[Followed, str, str], None],
        *,
        model: str | None = None,
        node: str | None = None,
        directory: Path | None = None,
    ) -> None:
        """``model``: the instance's ``compat["model"]``, the server-side filter (None: every
        group); ``node``, ``directory``: `NodeFeed`'s (default: this node, the runtime dir)."""
        self._settings = settings
        self._release = release
        self._on_release = on_release
        self._feed_args: dict[str, Any] = {"model": model, "node": node, "directory": directory}
        self._lock = threading.Lock()
        self._followed: dict[str, Followed] = {}  # by the registry's engine id
        self._groups: dict[str, Engine | None] = {}  # as the watch last said them
        # engine id -> (next check at, give up at): vLLM did not hold it yet, or the watch's
        # word was older than its handshake
        self._pending: dict[str, tuple[float, float]] = {}
        self._since: dict[str, float] = {}  # engine id -> when it was followed
        self._feed: NodeFeed | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()

    @property
    def feed(self) -> NodeFeed | None:
        return self._feed

    def follow(self, vllm_engine_id: str, planned: Handshake) -> None:
        """Called once vLLM loaded ``planned``'s ranks (its handshake thread)."""
        followed = Followed(vllm_engine_id, planned.engine_id, planned.group_id, planned.generation)
        with self._lock:
            self._followed[planned.engine_id] = followed
            if self._feed is None:
                self._feed = NodeFeed(self._settings, self.apply, **self._feed_args)
                self._feed.start()
                threading.Thread(
                    target=self._retry, name="engine-registry-release", daemon=True
                ).start()
            self._since[planned.engine_id] = time.monotonic()
            known = planned.group_id in self._groups
            engine = self._groups.get(planned.group_id)
        if known:
            self._check(followed, engine)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._feed is not None:
            self._feed.close()

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

    def _check(self, followed: Followed, engine: Engine | None) -> bool:
        """Release ``followed`` if ``engine`` (its group now) says so; False when put off (the
        retry loop judges it again): vLLM did not hold it yet, or the word may be older
        than the handshake (`SETTLE_S`)."""
        verdict = stale_cause(followed, engine)
        if verdict is None or (engine is not None and engine.generation < followed.generation):
            return True  # current, or the watch has not reached the handshake's engine yet
        kind, why = verdict
        now = time.monotonic()
        settled_at = self._since.get(followed.engine_id, 0.0) + SETTLE_S
        if kind != "superseded" and now < settled_at:
            self._put_off(followed.engine_id, settled_at)
            return False
        if not self._release(followed.vllm_engine_id):
            self._put_off(followed.engine_id, now + RETRY_BASE_S)
            return False
        with self._lock:
            self._followed.pop(followed.engine_id, None)
            self._since.pop(followed.engine_id, None)
        log.warning(
            "%s %s (group %r, generation %d): %s; vLLM frees its NIXL state at its next "
            "engine step once no read is in flight",
            MARK,
            followed.vllm_engine_id,
            followed.group_id,
            followed.generation,
            why,
        )
        self._on_release(followed, kind, why)
        return True

    def _put_off(self, engine_id: str, at: float) -> None:
        with self._lock:
            self._pending.setdefault(engine_id, (at, at + RETRY_FOR_S))
        self._wake.set()

    def _retry(self) -> None:
        """One loop for every release vLLM was not ready for and every judgement put off,
        each on its group's latest word."""
        backoff = Backoff(base_s=RETRY_BASE_S, cap_s=RETRY_CAP_S)
        while not self._stop.is_set():
            with self._lock:
                next_at = min((at for at, _ in self._pending.values()), default=None)
            if next_at is None:
                backoff.reset()
                self._wake.wait(RETRY_FOR_S)
                self._wake.clear()
                continue
            if (wait := next_at - time.monotonic()) > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            now = time.monotonic()
            with self._lock:
                due = [(eid, until) for eid, (at, until) in self._pending.items() if at <= now]
                for engine_id, _ in due:
                    del self._pending[engine_id]
            retry_at = now + backoff.next()
            for engine_id, until in due:
                with self._lock:
                    followed = self._followed.get(engine_id)
                    engine = self._groups.get(followed.group_id) if followed else None
                if followed is None or self._check(followed, engine):
                    continue  # released meanwhile, released now, or current
                with self._lock:  # `_check` put it off again: at the next pause
                    if time.monotonic() < until:
                        self._pending[engine_id] = (retry_at, until)
                        continue
                    self._pending.pop(engine_id, None)
                log.info(
                    "engine-registry: vLLM holds no state for remote engine %s after %g s "
                    "(its handshake never completed): nothing to release",
                    followed.vllm_engine_id,
                    RETRY_FOR_S,
                )
