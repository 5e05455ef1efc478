"""vLLM's MooncakeConnector with the registry as its bootstrap server (docs/vllm-plugin.md
"Mooncake").

Prefill: before the connector is made, ``bootstrap_server_address`` points at the registry
(unless given), so each rank's ``POST /register`` lands there, under the engine_id the
registry issued (the worker side's identity sync); the rank's agent, published as for any
connector, is what keeps its entry in ``/query``. Decode: each remote engine's bootstrap is
read from the registry (``{registry}/mooncake/{engine_id}/query``) whatever address the
router handed, so a router that only knows a prefill's host (smg builds
``http://{prefill host}:{bootstrap_port}``) still reaches the current generation, and a
superseded engine's request fails at once (410).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from workers.vllm_plugin.common import log
from workers.vllm_plugin.resolve import split_dp_suffix
from workers.vllm_plugin.settings import PluginSettings

CONNECTOR = "MooncakeConnector"
MARK = "engine-registry mooncake"


def is_mooncake(config: Any) -> bool:
    kv = getattr(config, "kv_transfer_config", None)
    return kv is not None and str(getattr(kv, "kv_connector", "")) == CONNECTOR


def registry_url(settings: PluginSettings) -> str | None:
    """The first registry URL, when vLLM's plain HTTP client can use it: http://, no token
    (vLLM sends no credentials on the bootstrap protocol)."""
    url = settings.urls.split(",")[0].strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or settings.token:
        return None
    return url


def point_prefill(config: Any, settings: PluginSettings) -> None:
    """``bootstrap_server_address`` = the registry's host:port, unless the launch gave one."""
    kv = config.kv_transfer_config
    extra = kv.kv_connector_extra_config
    if extra.get("bootstrap_server_address"):
        return
    url = registry_url(settings)
    if url is None:
        log.warning(
            "%s: the registry (%s) is not plain http:// without a token; vLLM's bootstrap "
            "protocol carries neither TLS settings nor credentials: vLLM's own bootstrap "
            "server is used",
            MARK,
            settings.urls,
        )
        return
    parts = urlsplit(url)
    extra["bootstrap_server_address"] = parts.netloc
    log.info("%s: prefill workers register at %s/register", MARK, url)


def bootstrap_of(url: str, engine_id: str) -> str:
    """``{registry}/mooncake/{engine_id}``, the engine's id without vLLM's ``_dp{rank}``."""
    return f"{url}/mooncake/{split_dp_suffix(engine_id)[0]}"


def attach_decode(worker: Any, settings: PluginSettings) -> bool:
    """Read each remote engine's workers from the registry: ``handle_new_engine_id`` (vLLM's
    first request naming an engine) gets the registry's URL for it. False when ``worker`` is
    not vLLM's Mooncake worker or the registry is not reachable the way vLLM asks."""
    handle = getattr(worker, "handle_new_engine_id", None)
    url = registry_url(settings)
    if handle is None or url is None:
        return False

    async def from_registry(remote_engine_id: str, pull_metas: dict[str, Any]) -> Any:
        at = bootstrap_of(url, str(remote_engine_id))
        for meta in pull_metas.values():
            meta.remote_bootstrap_addr = at
        return await handle(remote_engine_id, pull_metas)

    worker.handle_new_engine_id = from_registry
    log.info("%s: decode reads prefill workers from %s/mooncake/<engine_id>", MARK, url)
    return True
