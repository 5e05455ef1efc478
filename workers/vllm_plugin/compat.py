"""What a decode instance must share with a prefill one, as the registry's `compat` object.

The registry refuses a handshake between engines whose shared `compat` keys differ. On CPU
that includes the attention ISA vLLM picked (`attn_isa`): its CPU attention writes the KV
cache in an ISA-specific layout (the `amx` one is packed for AMX tiles), so KV pulled from an
AMX prefill is not readable by a decode running the `vec` kernel, and the reverse. It also
tells which kernel a run covered (the real-vLLM tier prints it).
"""

from __future__ import annotations

import logging
from typing import Any

from registry_client.models import Compat

log = logging.getLogger("vllm.engine_registry")


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def attn_isa(config: Any) -> str | None:
    """The ISA vLLM's CPU attention uses for this config (its own selector); None off CPU."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = config.model_config, config.cache_config
        return str(
            _get_attn_isa(
                model.dtype, int(cache.block_size), model.get_head_size(), cache.cache_dtype
            )
        )
    except Exception as exc:  # a report, never a reason not to start
        log.warning("engine-registry: could not tell vLLM's CPU attention ISA: %r", exc)
        return None


def compat_of(config: Any) -> Compat:
    """Flat JSON scalars: model, dtypes, connector, vLLM version, block size, CPU attn ISA."""
    model = config.model_config
    cache = config.cache_config
    compat: Compat = {
        "model": str(getattr(model, "model", "")),
        "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "kv_connector": str(config.kv_transfer_config.kv_connector),
        "vllm_version": vllm_version().split("+", 1)[0],
    }
    block_size = getattr(cache, "block_size", None)
    if isinstance(block_size, int):
        compat["block_size"] = block_size
    isa = attn_isa(config)
    if isa is not None:
        compat["attn_isa"] = isa
    return compat
