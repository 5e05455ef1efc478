"""NIXL's progress thread set to wait for events (workers.nixl_progress), with real NIXL: the
delay reaches the agent's configuration, 0 restores NIXL's own, a bad setting names itself.
A real READ between two processes with it: tests/workers/test_endpoint.py (NixlEndpoint
applies it); what it changes in time and CPU: bench/nixl_progress.py."""

from __future__ import annotations

from typing import Any

import pytest

from workers import nixl_progress

pytestmark = pytest.mark.unit


def test_the_delay_reaches_every_new_agents_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    bind = nixl_progress.bindings()
    assert bind is not None
    seen: list[tuple[bool, int]] = []
    real = bind.nixlAgent

    def recording(name: str, config: Any) -> Any:
        seen.append((bool(config.useProgThread), int(config.pthrDelay)))
        return real(name, config)

    monkeypatch.setattr(bind, "nixlAgent", recording)
    assert nixl_progress.apply(1000) == 1000
    assert nixl_progress.apply(1000) == 1000  # twice: one wrapper, not two
    nixl_agent("progress-a", nixl_agent_config(backends=["UCX"]))
    nixl_agent("progress-b", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    assert nixl_progress.apply(0) == 0
    nixl_agent("progress-c", nixl_agent_config(backends=["UCX"]))
    # NIXL itself sets 0 (busy polling); the wrapper raises it only with a progress thread.
    assert seen == [(True, 1000), (False, 0), (True, 0)]


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nixl_progress.ENV, "250")
    assert nixl_progress.delay_from_env() == 250
    monkeypatch.delenv(nixl_progress.ENV)
    assert nixl_progress.delay_from_env() == nixl_progress.DEFAULT_US
    for bad in ("-1", "1ms"):
        monkeypatch.setenv(nixl_progress.ENV, bad)
        with pytest.raises(ValueError, match=nixl_progress.ENV):
            nixl_progress.delay_from_env()
