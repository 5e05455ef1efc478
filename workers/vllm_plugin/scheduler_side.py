"""The scheduler side (the engine core's `Scheduler`): adopt the workers' engine_id.

It re-opens the engine with the launch's `launch_id`: the registry answers the engine the
workers opened (it never opens a second one for a retried launch_id), so the
`remote_engine_id` handed to decode instances is the registry's. Finding none (the registry
opened a new generation for it) means the workers ran without the plugin: the start stops.
"""

from __future__ import annotations

from typing import Any

from registry_client.errors import RegistryError
from workers.vllm_plugin import common
from workers.vllm_plugin.common import log
from workers.vllm_plugin.settings import PluginSettings


def scheduler_adopt(config: Any) -> None:
    settings = PluginSettings.from_env()
    group_id, dp_rank = common.group_id(config, settings)
    parallel = config.parallel_config
    size = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    with common.client(settings) as client:
        try:
            engine, created = client.open_engine(
                group_id,
                launch_id=settings.launch_id,
                tp_size=size,
                role=common.role(config, settings),
                timeout_s=settings.timeout_s,
            )
        except RegistryError as exc:
            raise RuntimeError(
                f"engine-registry: the scheduler of group {group_id!r} could not adopt its "
                f"engine (launch {settings.launch_id}): {exc}"
            ) from exc
    if created:
        raise RuntimeError(
            f"engine-registry: the scheduler of group {group_id!r} found no engine opened by "
            f"its workers for launch {settings.launch_id} (it opened generation "
            f"{engine.generation} itself): were the workers started without the plugin?"
        )
    engine_id = common.vllm_engine_id(engine.engine_id, dp_rank)
    config.kv_transfer_config.engine_id = engine_id
    log.info(
        "engine-registry: scheduler of group %r uses the registry's engine_id %s (generation %d)",
        group_id,
        engine_id,
        engine.generation,
    )
