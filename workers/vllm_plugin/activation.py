"""Whether the plugin is on (``ENGINE_REGISTRY_URL`` set), and the vLLM releases it supports:
the standard library only, so that vLLM's import of the plugin is cheap and never fails."""

from __future__ import annotations

import os

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
ENV_URL = "ENGINE_REGISTRY_URL"


def active() -> bool:
    return bool(os.environ.get(ENV_URL, "").strip())
