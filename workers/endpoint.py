"""A rank's NIXL endpoint: its agent, its registered KV memory, and where peers reach it.

Data path (`NixlEndpoint`) and control path (`workers.publication`, which this module does
not import) are separate, as in vLLM's connector: the first never talks HTTP, the second
never touches NIXL.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from registry_client.errors import TransferError
from registry_client.models import Target

log = logging.getLogger(__name__)

__all__ = [
    "NixlEndpoint",
    "RemoteRead",
    "advertise_host",
    "check_host_for_group",
    "stop_on_signals",
]

ADVERTISE_HOST_ENV = "WORKERS_ADVERTISE_HOST"


@dataclass(frozen=True)
class RemoteRead:
    """One READ: `remote` descriptors of agent `remote_name` into `local` ones."""

    remote_name: str
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    remote_mem_type: str


class NixlEndpoint:
    """One `nixl_agent` per rank (UCX backend) and the memory it registered."""

    def __init__(self, agent_name: str, *, backends: tuple[str, ...] = ("UCX",)) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from workers import nixl_progress

        nixl_progress.apply()  # its progress thread waits for events (workers/nixl_progress.py)
        self.name = agent_name
        self.agent: Any = nixl_agent(agent_name, nixl_agent_config(backends=list(backends)))
        self._registered: list[Any] = []
        self._remotes: set[str] = set()

    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor (DRAM on CPU, VRAM on a GPU) with every backend."""
        if not tensor.is_contiguous():
            raise ValueError("KV memory must be one contiguous tensor")
        self._registered.append(self.agent.register_memory(tensor))

    def metadata(self) -> bytes:
        """Agent metadata to publish; taken after registration so it describes the memory."""
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, target: Target) -> str:
        """Load a target's metadata; refuse it unless it names the agent the registry named."""
        raw = self.agent.add_remote_agent(target.agent_metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._remotes.add(name)
        if name != target.agent_name:
            self.remove_remote(name)
            raise TransferError(
                f"remote rank {target.rank}: metadata names agent {name!r}, "
                f"registry says {target.agent_name!r}"
            )
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # a dead peer must not block cleanup
                log.warning("removing remote agent %s: %s", name, exc)

    def read(
        self,
        reads: list[RemoteRead],
        *,
        local_mem_type: str,
        deadline_s: float,
    ) -> None:
        """Post every READ at once (one per remote agent), then wait for all of them.

        Each side has its own memory type (`DRAM`/`VRAM`): a decode on GPUs may read from a
        prefill that keeps its KV in host memory, and the other way round. Handles are
        released whatever happens; a transfer still running at the deadline is an error.
        """
        handles: list[tuple[str, Any]] = []
        try:
            for r in reads:
                local = self.agent.get_xfer_descs(
                    np.array(r.local, dtype=np.uint64), local_mem_type
                )
                remote = self.agent.get_xfer_descs(
                    np.array(r.remote, dtype=np.uint64), r.remote_mem_type
                )
                try:
                    handle = self.agent.initialize_xfer("READ", local, remote, r.remote_name)
                    handles.append((r.remote_name, handle))
                    state = self.agent.transfer(handle)
                except Exception as exc:  # nixl raises its own errors (e.g. disconnected)
                    raise TransferError(f"READ from {r.remote_name}: {exc}") from exc
                if state == "ERR":
                    raise TransferError(f"READ from {r.remote_name} failed to post")
            end = time.monotonic() + deadline_s
            pending = list(handles)
            while pending:
                still = []
                for name, handle in pending:
                    try:
                        state = self.agent.check_xfer_state(handle)
                    except Exception as exc:
                        raise TransferError(f"READ from {name}: {exc}") from exc
                    if state == "ERR":
                        raise TransferError(f"READ from {name} failed")
                    if state == "PROC":
                        still.append((name, handle))
                pending = still
                if pending:
                    if time.monotonic() > end:
                        names = [name for name, _ in pending]
                        raise TransferError(f"READ from {names} not done after {deadline_s}s")
                    time.sleep(0.0005)
        finally:
            for _, handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as exc:
                    log.warning("releasing transfer handle: %s", exc)

    def notify(self, remote_name: str, message: bytes) -> None:
        try:
            self.agent.send_notif(remote_name, message)
        except Exception as exc:
            raise TransferError(f"notifying {remote_name}: {exc}") from exc

    def notifications(self) -> dict[str, list[bytes]]:
        return dict(self.agent.get_new_notifs())

    def close(self) -> None:
        """Remove remote agents, deregister memory. Idempotent."""
        for name in list(self._remotes):
            self.remove_remote(name)
        while self._registered:
            descs = self._registered.pop()
            try:
                self.agent.deregister_memory(descs)
            except Exception as exc:
                log.warning("deregistering memory: %s", exc)


def advertise_host(registry_url: str, override: str | None = None) -> str:
    """The address peers should use for this rank: the one that routes to the registry.

    `override` (or $WORKERS_ADVERTISE_HOST) wins. The answer is never unspecified; it is
    loopback only when the registry itself is on loopback (every rank on one machine).
    """
    host = override or os.environ.get(ADVERTISE_HOST_ENV)
    if not host:
        parts = urlsplit(registry_url)
        target = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        info = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
            probe.connect(info[4])  # UDP connect sends nothing; it only picks a route
            host = str(probe.getsockname()[0])
    if ipaddress.ip_address(host).is_unspecified:
        raise ValueError(f"refusing to advertise unspecified address {host}")
    return host


def check_host_for_group(host: str, hostnames: list[str]) -> None:
    """Refuse a loopback address when the group's ranks run on different machines."""
    if len(set(hostnames)) > 1 and ipaddress.ip_address(host).is_loopback:
        raise ValueError(
            f"advertised host {host} is loopback but the group spans hosts "
            f"{sorted(set(hostnames))}; set {ADVERTISE_HOST_ENV}"
        )


def stop_on_signals(
    stop: threading.Event, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """Turn SIGTERM/SIGINT into `stop.set()`, so the main loop shuts down cleanly."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    for sig in signals:
        signal.signal(sig, handler)
