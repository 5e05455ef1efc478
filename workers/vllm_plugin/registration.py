"""The vLLM plugin's lease on one rank's agent: registered, renewed every ttl/3 (registered
again after a 404, stopped on a 409), removed at exit."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from typing import Any

from workers.client import RegistryClient
from workers.errors import EngineIdMismatch, NotFound, RegistryError

log = logging.getLogger("vllm.engine_registry")


class Registration:
    """One rank's agent in the registry: registered, renewed every ttl/3, removed at exit."""

    def __init__(
        self, client: RegistryClient, ttl_s: int, group_id: str, rank: int, body: dict[str, Any]
    ):
        self.ttl_s = ttl_s
        self.group_id = group_id
        self.rank = rank
        self.body = {**body, "ttl_s": ttl_s}
        self.engine_id = str(body["engine_id"])
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew, name="engine-registry-lease", daemon=True
        )

    def _path(self) -> str:
        return f"/tp-groups/{self.group_id}/engine/agents/{self.rank}"

    def register(self) -> None:
        self.client.request("PUT", self._path(), json=self.body)

    def start(self) -> None:
        self.register()
        self._thread.start()
        atexit.register(self.close)
        log.info(
            "engine-registry: rank %d registered agent %s of engine %s (lease %d s)",
            self.rank,
            self.body["agent_name"],
            self.engine_id,
            self.ttl_s,
        )

    def _renew(self) -> None:
        period = max(1.0, self.ttl_s / 3)
        while not self._stop.wait(period):
            try:
                self.client.heartbeat(
                    self.group_id, self.rank, engine_id=self.engine_id, timeout_s=period
                )
            except NotFound:
                try:  # the lease lapsed (a pause, a registry restart): register again
                    self.register()
                except RegistryError as exc:
                    log.warning("engine-registry: re-registering rank %d: %s", self.rank, exc)
            except EngineIdMismatch as exc:
                log.warning(
                    "engine-registry: rank %d's engine %s was superseded (%s); lease stops",
                    self.rank,
                    self.engine_id,
                    exc.detail,
                )
                return
            except RegistryError as exc:
                log.warning("engine-registry: renewing rank %d's lease: %s", self.rank, exc)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(RegistryError):
            self.client.deregister_agent(
                self.group_id, self.rank, engine_id=self.engine_id, timeout_s=2.0
            )
        self.client.close()
