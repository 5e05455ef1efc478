"""Pipeline parallelism with disaggregated prefill: what vLLM allows, said at start.

With PP > 1 each stage's workers hold a slice of the layers, so a KV connector must serve every
stage's handshake metadata: vLLM's engine core hands it the workers' metadata keyed by
`(pp_rank, tp_rank)` (`KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware`, called from
`v1/engine/core.py` once the KV caches exist). The base class raises there on any `pp_rank > 0`
("does not support PP-disaggregated KV transfer"): a connector that does not override it fails
only after the model is loaded. A worker of a PP > 1 instance with a KV connector checks that
before the connector is made and refuses with one line naming the limit, or says in one line
what holds for a connector that does override it (vLLM 0.32's NixlConnector serves every
stage on its side channel; the registry's handshake plans TP only, so decode handshakes with a
PP prefill go over vLLM's side channel).
"""

from __future__ import annotations

from typing import Any

from workers.vllm_plugin.common import log
from workers.vllm_plugin.settings import PluginConfigError

BASE_LIMIT = "KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware"


def pp_limit(connector_cls: type, base_cls: type, pp_size: int) -> str | None:
    """Why a PP `pp_size` instance cannot run `connector_cls` (None: it can, or PP is 1)."""
    if pp_size <= 1:
        return None
    method = "set_xfer_handshake_metadata_pp_aware"
    if getattr(connector_cls, method, None) is getattr(base_cls, method, None):
        return (
            f"vLLM's {connector_cls.__name__} does not support PP-disaggregated KV transfer: "
            f"with pipeline_parallel_size {pp_size} vLLM's {BASE_LIMIT} raises on the "
            "handshake metadata of pp_rank > 0 once the KV caches exist; run this instance "
            "with PP 1 (TP or DP instead), or a connector that serves every PP stage"
        )
    return None


def check(config: Any, pp_size: int, group_id: str) -> None:
    """At a PP > 1 worker's start: refuse a connector vLLM gives no PP handshake, else one
    line on what PP means for this instance's KV transfer."""
    kv = getattr(config, "kv_transfer_config", None)
    if pp_size <= 1 or kv is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    connector_cls = KVConnectorFactory.get_connector_class(kv)
    reason = pp_limit(connector_cls, KVConnectorBase_V1, pp_size)
    if reason is not None:
        log.error("engine-registry: group %r refuses to start: %s", group_id, reason)
        raise PluginConfigError(f"engine-registry: group {group_id!r}: {reason}")
    log.warning(
        "engine-registry: group %r runs pipeline_parallel_size %d with %s: vLLM serves every "
        "PP stage's handshake on its side channel; the registry plans TP only, so a decode's "
        "handshake with this engine goes over vLLM's side channel (and vLLM's NIXL pull "
        "refuses PP with a hybrid KV cache)",
        group_id,
        pp_size,
        connector_cls.__name__,
    )
