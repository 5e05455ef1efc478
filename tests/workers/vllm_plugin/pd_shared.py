"""What the real-vLLM PD tests share (`test_vllm_pd.py`, and `test_mooncake_pd_gpu.py` with its
own connector and shape): the registry, the one decode instance the module keeps, the prefill
instance of the moment, vllm-router, and when each launch became healthy (for the
requests-per-node summary)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from registry_client.client import RegistryClient
from tests.workers.vllm_plugin.routing import Routing
from workers.tools.vllm_launch import ROOT, Instance, Registry
from workers.tools.vllm_pd import pd_complete

NOFIX = {"PYTHONPATH": str(ROOT / "tests" / "workers" / "vllm_plugin" / "nofix")}
PROMPT = "The registry issues one engine id per launch of a tensor parallel group"
# A two-node prefill on this 2-core Intel machine, idle, became healthy in 93 s on one run
# and took more than 300 s on others (torch.distributed's group set-up between its nodes, then
# NIXL's initialisation, each minutes slower); cause not found yet, so the bound is generous.
START_S = 600.0


@dataclass
class Shared:
    workdir: Path
    model: Path
    registry: Registry
    decode_process: Instance | None = None
    prefill: Instance | None = None
    routing_process: Routing | None = None
    launches: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    # Per role ("prefill", "decode"): `Instance` arguments beyond the defaults, `extra_env`
    # added to the role's own; and the prefill's TP, one node per rank.
    launch: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    prefill_tp: int = 2

    def routing(self) -> Routing:
        """vllm-router and router-sync, started once, kept across the tests."""
        if self.routing_process is None:
            reader = self.registry.tokens.reader
            self.routing_process = Routing.start(self.workdir, self.registry.url, reader)
        return self.routing_process

    @property
    def decode(self) -> Instance:
        assert self.decode_process is not None, "decode starts after each prefill is healthy"
        return self.decode_process

    def _launch(self, role: str, env: Mapping[str, str]) -> dict[str, Any]:
        given = dict(self.launch.get(role, {}))
        given["extra_env"] = {**env, **given.get("extra_env", {})}
        return given

    def decode_instance(self, **env: str) -> Instance:
        # The KV-pull watch says every pull's stage (handshake pending, READ posted).
        launch = self._launch("decode", {"ENGINE_REGISTRY_KV_WAIT_WARN_S": "0.001"})
        launch["extra_env"].update(env)
        return Instance(
            "decode",
            self.model,
            self.workdir,
            registry_url=self.registry.url,
            registry_token=self.registry.token("worker"),
            group="decode-0",
            role="decode",
            **launch,
        )

    def body(self, max_tokens: int = 8) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
        }

    def client(self, role: str = "reader") -> RegistryClient:
        return RegistryClient(self.registry.url, token=self.registry.token(role))

    def pd(self, prefill: Instance) -> tuple[httpx.Response, dict[str, Any]]:
        """A PD request through `prefill` and the shared decode, bounded, decode's log on fail."""
        return pd_complete(
            prefill.url, self.decode.url, self.body(), decode_logs=self.decode.log_text
        )

    def prefill_instance(self, name: str, *, plugin: bool, **kw: Any) -> Instance:
        launch = self._launch("prefill", {**NOFIX, "ENGINE_REGISTRY_TTL_S": "10"})
        return Instance(
            name,
            self.model,
            self.workdir,
            tp=self.prefill_tp,
            nodes=self.prefill_tp,
            registry_url=self.registry.url if plugin else None,
            registry_token=self.registry.token("worker"),
            group="prefill-0",
            role="prefill",
            **{**launch, **kw},
        )
