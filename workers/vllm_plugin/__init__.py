"""vLLM general plugin: the engine registry gives vLLM its engine_id, and knows every instance.

Registered under vLLM's `vllm.general_plugins` entry-point group as `engine_registry =
workers.vllm_plugin:register`. vLLM calls `register()` in every process it starts (the API
server, the engine core, each worker). Importing this module is cheap and never fails (vLLM
only logs an import error); everything that needs vLLM happens inside `register()`.

Dormant unless `ENGINE_REGISTRY_URL` is set. When active (`hook` patches the connector
factory; `worker_side` and `scheduler_side` are the two halves, as in vLLM's NIXL connector):

- every worker, before its KV connector is made: TP rank 0 opens the engine of this launch,
  every rank fetches it and cross-verifies over vLLM's own TP group (the model-parallel world
  when PP > 1), and `kv_transfer_config.engine_id` becomes the registry's id (with vLLM's
  `_dp{rank}` suffix under data parallelism, one registry group per DP rank);
- the engine core's scheduler-side connector adopts the same id (same launch_id, so the
  registry answers the same engine), so the `remote_engine_id` it hands out is the registry's;
- after the KV caches are registered, each rank registers its NIXL agent (name, metadata, KV
  layout, side channel) with a lease, renews it, and deregisters on shutdown;
- the API server, once it answers, publishes where the instance serves, for routers
  (`workers.vllm_plugin.serving`).

Environment (`workers.vllm_plugin.settings.PluginSettings`; a bad value stops the start
naming the variable, the value and the form expected):

    ENGINE_REGISTRY_URL      registry URL(s), comma-separated replicas (activates the plugin)
    ENGINE_REGISTRY_GROUP    the TP group id (required when active); "-dp{rank}" is appended
                             per data-parallel rank
    ENGINE_REGISTRY_TOKEN    bearer token with the worker role (optional)
    ENGINE_REGISTRY_TOKEN_FILE  a file whose first line is the token (when no token is set)
    ENGINE_REGISTRY_CA       PEM CA bundle for https:// URLs (default: the system store)
    ENGINE_REGISTRY_CERT, ENGINE_REGISTRY_KEY  client certificate and key (mutual TLS)
    ENGINE_REGISTRY_ROLE     prefill | decode | both (default from kv_role: kv_producer ->
                             prefill, kv_consumer -> decode, kv_both -> both)
    ENGINE_REGISTRY_TTL_S    agent lease in seconds, 5-3600 (default 30; renewed every ttl/3)
    ENGINE_REGISTRY_TIMEOUT_S  deadline of each registry call at start (default 30)
    ENGINE_REGISTRY_REFUSE_EXIT_S  a worker that refused its identity exits this many seconds
                             after raising (default 10), so headless nodes stop too
    ENGINE_REGISTRY_CHECK_REMOTE  a decode handshake asks the registry first (default true)
    ENGINE_REGISTRY_ADVERTISE_URL  the URL routers reach this instance's API at (default:
                             http://{--host}:{--port}); published once the API answers
    ENGINE_REGISTRY_LAUNCH_ID  made up by the first process of a launch when unset, inherited
                             by its engine core and workers; set it only to a value that changes
                             exactly when the group is relaunched (a leader pod's UID)
"""

from __future__ import annotations

from workers.vllm_plugin.activation import ENV_URL, SUPPORTED_VLLM_VERSIONS, active


def register() -> None:
    """vLLM's general-plugin entry point: install the hooks when configured."""
    if not active():
        return
    from workers.vllm_plugin.hook import install

    install()


__all__ = ["ENV_URL", "SUPPORTED_VLLM_VERSIONS", "active", "register"]
