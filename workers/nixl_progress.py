"""NIXL's UCX progress thread, woken by events instead of polling without pause.

NIXL's Python API makes every agent with ``pthrDelay = 0`` (``nixl_agent.__init__``; no
setting changes it), and its UCX backend's progress thread (``nixlUcxSharedThread::run``)
then calls ``poll()`` with a timeout of 0 in a loop: one thread per agent at 100% of a core,
whether or not anything moves. A NIXL READ's completion needs the remote agent's progress
thread to run (on DRAM over TCP, UCX emulates the get with active messages the target
handles), so on a machine with fewer cores than busy threads (2 cores: a TP-2 prefill and a
decode are 3 such threads, beside vLLM's own busy loops) a READ waits for the scheduler to
give the target's thread a turn: the first pull of a vLLM PD request took 0.4-7.1 s there,
and a READ in a two-process test 8.9 s, against 0.045 s with the delay below
(docs/vllm-plugin.md "NIXL progress"; the measurement is `bench/nixl_progress.py`).

With a delay of at least 1 µs the same thread arms the UCX worker and sleeps in ``poll()``
on its event descriptor (at most the delay rounded up to 1 ms): it wakes as soon as a
message arrives, and idles at ~0% CPU. `apply` sets that delay on every agent made after it
in this process, by wrapping the bindings' agent constructor; an explicit non-zero delay is
left alone. 0 keeps NIXL's own busy polling.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

ENV = "ENGINE_REGISTRY_NIXL_PROGRESS_US"
DEFAULT_US = 1000
_WRAPPED = "_engine_registry_progress_us"

log = logging.getLogger("workers.nixl_progress")


def delay_from_env(default_us: int = DEFAULT_US) -> int:
    """``ENGINE_REGISTRY_NIXL_PROGRESS_US`` as whole microseconds (0: NIXL's busy polling)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return default_us
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected whole microseconds >= 0") from None
    if value < 0:
        raise ValueError(f"{ENV}={raw!r}: expected whole microseconds >= 0")
    return value


def bindings() -> Any | None:
    """The `_bindings` module behind ``nixl._api`` (nixl_cu12, nixl_cu13, ...), or None."""
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return None
    package = nixl_agent.__module__.rsplit(".", 1)[0]
    try:
        return importlib.import_module(f"{package}._bindings")
    except ImportError:
        return None


def apply(delay_us: int | None = None) -> int | None:
    """Make agents created from now on in this process wait for events, at most
    ``delay_us`` (default: from the environment) between polls. Returns the delay in
    force, or None when NIXL is not installed or has no such constructor."""
    delay = delay_from_env() if delay_us is None else delay_us
    bind = bindings()
    if bind is None or not hasattr(bind, "nixlAgent"):
        return None
    current = bind.nixlAgent
    wrapped_at = getattr(current, _WRAPPED, None)
    if wrapped_at is not None:
        current = current.__wrapped__
    if delay == 0:
        bind.nixlAgent = current
        return 0
    real = current

    def nixl_agent(name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False) and int(config.pthrDelay) == 0:
            config.pthrDelay = delay
        return real(name, config)

    nixl_agent.__wrapped__ = real  # type: ignore[attr-defined]
    setattr(nixl_agent, _WRAPPED, delay)
    bind.nixlAgent = nixl_agent
    if wrapped_at != delay:
        log.debug("NIXL progress threads wait for events, at most %d us between polls", delay)
    return delay
