"""The worker side (each vLLM worker's KV connector): agree on the engine_id, then publish.

Before the connector is made (collective over vLLM's TP group, or its model-parallel world
when PP > 1): `workers.identity.sync_engine_id` opens (rank 0), fetches and cross-verifies the
engine; any disagreement raises the same `EngineIdentityError` on every rank, with its cause,
and the instance does not start. After the connector registered its KV caches: the rank's NIXL
agent is published with a lease (renewed every ttl/3, registered again after a 404, stopped on
a 409) and deregistered on shutdown or exit: by its node's first rank together with the node's
other ranks (`node_publish`, the default), or by itself (`workers.publication.Publication`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from registry_client.errors import EngineIdentityError, RegistryError
from registry_client.models import AgentItem, EngineIdentity, KvSpec
from workers.identity import sync_engine_id
from workers.publication import Publication
from workers.vllm_plugin import (
    common,
    kv_watch,
    mooncake,
    node_publish,
    pp_limit,
    stale,
    via_registry,
)
from workers.vllm_plugin.common import log
from workers.vllm_plugin.compat import compat_of
from workers.vllm_plugin.decode_side import attach_decode_side
from workers.vllm_plugin.node_publish import NodeShare
from workers.vllm_plugin.settings import PluginConfigError, PluginSettings


@dataclass
class _State:
    """What this process learned; one sync per process (sub-connectors reuse it)."""

    identity: EngineIdentity | None = None
    settings: PluginSettings | None = None  # read once, at the sync
    engine_id: str = ""  # what vLLM uses: the registry's id, plus `_dp{rank}` under DP
    group_id: str = ""
    rank: int = 0
    size: int = 1
    pp_size: int = 1
    compat: dict[str, Any] = field(default_factory=dict)
    clock: float = 0.0  # node 0's perf_counter - time.time(), broadcast from rank 0
    group: Any = None  # the CPU group the identity was agreed over (and a node's items go)
    node: str = ""  # this process's node (`common.node_name`)
    publication: Publication | NodeShare | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def worker_sync(config: Any) -> None:
    with _state.lock:
        if _state.identity is not None:
            config.kv_transfer_config.engine_id = _state.engine_id
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group

        settings = PluginSettings.from_env()
        _nixl_progress(settings)
        group_id, dp_rank = common.group_id(config, settings)
        tp = get_tp_group()
        pp = get_pp_group()
        tp_rank, pp_rank = int(tp.rank_in_group), int(pp.rank_in_group)
        if pp.world_size == 1:
            pg, size = tp.cpu_group, int(tp.world_size)
        elif dp_rank is None:
            # PP > 1: one engine over every stage; the world is this instance's TP x PP ranks.
            world = get_world_group()
            pg, size = world.cpu_group, int(world.world_size)
        else:
            raise PluginConfigError(
                "engine-registry plugin: pipeline and data parallelism together are not "
                "supported yet (no process group spans one DP replica's stages)"
            )
        rank = pp_rank * int(tp.world_size) + tp_rank
        pp_limit.check(config, int(pp.world_size), group_id)
        before = config.kv_transfer_config.engine_id
        compat = compat_of(config)
        with common.client(settings) as client:
            try:
                identity = sync_engine_id(
                    client,
                    group_id,
                    tp_size=size,
                    role=common.role(config, settings),
                    compat=compat,
                    group=pg,
                    cpu_group=pg,
                    launch_id=settings.launch_id,
                    timeout_s=settings.timeout_s,
                )
            except EngineIdentityError as exc:
                log.error(
                    "engine-registry: rank %d of group %r refuses to start: %s",
                    rank,
                    group_id,
                    exc,
                )
                _exit_soon(settings.refuse_exit_s)
                raise RuntimeError(
                    f"engine-registry: group {group_id!r} rank {rank} refuses to start: {exc}"
                ) from exc
        engine_id = common.vllm_engine_id(identity.engine_id, dp_rank)
        config.kv_transfer_config.engine_id = engine_id
        if mooncake.is_mooncake(config):
            mooncake.point_prefill(config, settings)
        _state.identity = identity
        _state.settings = settings
        _state.engine_id = engine_id
        _state.group_id = group_id
        _state.rank = rank
        _state.size = size
        _state.pp_size = int(pp.world_size)
        _state.compat = dict(compat)
        _state.clock = _node0_clock(pg)
        _state.group = pg
        _state.node = common.node_name(config)
        common.set_node(_state.node)
        log.info(
            "engine-registry: rank %d/%d (tp_rank %d, pp_rank %d) of group %r uses the "
            "registry's engine_id %s (generation %d, was %s)",
            rank,
            size,
            tp_rank,
            pp_rank,
            group_id,
            engine_id,
            identity.generation,
            before,
        )


def _nixl_progress(settings: PluginSettings) -> None:
    """This worker's NIXL agent (made right after) waits for events (workers/nixl_progress.py).
    vLLM's own NIXL module is imported first: it sets UCX variables before NIXL loads."""
    from workers import nixl_progress

    with contextlib.suppress(ImportError):
        import vllm.distributed.nixl_utils  # noqa: F401
    nixl_progress.apply(settings.nixl_progress_us)


def _node0_clock(pg: Any) -> float:
    """Rank 0's ``perf_counter() - time()``, on every rank: rank 0 runs on node 0, beside
    vLLM's scheduler, whose perf_counter stamps the KV blocks' expiry a decode checks."""
    import torch.distributed as dist

    clock: list[Any] = [via_registry.clock_reference() if dist.get_rank(pg) == 0 else None]
    dist.broadcast_object_list(clock, src=dist.get_global_rank(pg, 0), group=pg)
    return float(clock[0])


def _exit_soon(delay_s: float) -> None:
    """Make sure a worker that refused its identity never lingers.

    The raise below reaches vLLM's driver as the failed RPC, and node 0's engine core stops.
    A headless node's worker, though, answers the failure and waits for the next RPC from a
    driver that is gone, and its launcher waits on it. So the refusing worker exits on its own
    once the error had time to travel; vLLM's worker monitor then stops that node too.
    """

    def leave() -> None:
        time.sleep(delay_s)
        log.error("engine-registry: exiting this worker (it refused its engine identity)")
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=leave, name="engine-registry-refused", daemon=True).start()


# -- the rank's agent ----------------------------------------------------------------------


def side_channel() -> tuple[str, int]:
    """Where this instance serves NIXL handshakes (vLLM's scheduler, for every rank)."""
    host = (
        os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        or os.environ.get("VLLM_HOST_IP")
        or "127.0.0.1"
    )
    return host, int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))


def agent_item(connector: Any, config: Any) -> AgentItem:
    """This rank's agent record: the NIXL agent when the connector exposes one, else only
    the side channel (`kv.side_channel_host`/`_port`, where vLLM serves the handshake)."""
    assert _state.identity is not None
    host, port = side_channel()
    dp_index = int(getattr(config.parallel_config, "data_parallel_index", 0) or 0)
    worker = getattr(connector, "connector_worker", None)
    agent = getattr(worker, "nixl_wrapper", None)
    extra: dict[str, Any] = {
        "side_channel_host": host,
        "side_channel_port": port + dp_index,
        "vllm_engine_id": _state.engine_id,
        "kv_connector": type(connector).__name__,
        "rank": _state.rank,
    }
    name = f"{_state.engine_id}-rank{_state.rank}"
    metadata = b"no-nixl-agent"
    kv = KvSpec("DRAM", 0, [], 1, 1, extra=extra)
    if worker is not None and agent is not None:
        name = str(getattr(agent, "name", name))
        metadata = bytes(agent.get_agent_metadata())
        payload = getattr(worker, "xfer_handshake_metadata", None)
        if payload is not None:
            # What vLLM's side channel serves for this rank, byte for byte: a decode loads
            # it from the registry (`via_registry`) without dialing the side channel.
            import msgspec

            metadata = msgspec.msgpack.Encoder().encode(payload)
            extra["blob"] = via_registry.BLOB_FORMAT
            extra["scheduler_clock"] = _state.clock
        addrs = getattr(worker, "kv_caches_base_addr", {}).get(worker.engine_id, {})
        lens = list(getattr(worker, "block_len_per_layer", []) or [1])
        extra["kv_cache_layout"] = str(getattr(worker, "kv_cache_layout", ""))
        extra["tp_rank"] = int(worker.tp_rank)
        kv = KvSpec(
            mem_type="DRAM",
            device_id=int(getattr(worker, "device_id", 0) or 0),
            base_addrs=[int(a) for a in addrs.get(worker.tp_rank, [])],
            num_blocks=max(1, int(getattr(worker, "num_blocks", 1) or 1)),
            block_len=max(1, int(lens[0])),
            extra=extra,
        )
    return AgentItem(_state.rank, _state.identity.engine_id, name, metadata, host, kv)


def publish(connector: Any, config: Any) -> Publication | NodeShare:
    """Register this rank's agent and keep its lease (by its node's leader, or by itself:
    ``ENGINE_REGISTRY_PUBLISH``); deregistered at exit."""
    assert _state.identity is not None
    assert _state.settings is not None
    if _state.settings.publish == "node":
        return _publish_by_node(connector, config)
    settings = _state.settings
    item = agent_item(connector, config)
    publication = Publication(
        lambda: common.client(settings),
        _state.identity,
        item.rank,
        agent_name=item.agent_name,
        metadata=item.agent_metadata,
        host=item.host,
        kv=item.kv,
        ttl_s=settings.ttl_s,
        logger=log,
        close_timeout_s=2.0,
    )
    try:
        publication.publish()
    except RegistryError as exc:
        publication.close(deregister=False)
        raise RuntimeError(
            f"engine-registry: rank {_state.rank} of group {_state.group_id!r} could "
            f"not register its agent: {exc}"
        ) from exc
    publication.start()
    atexit.register(publication.close)
    log.info(
        "engine-registry: rank %d registered agent %s of engine %s (lease %d s)",
        item.rank,
        item.agent_name,
        item.engine_id,
        settings.ttl_s,
    )
    return publication


def _publish_by_node(connector: Any, config: Any) -> NodeShare:
    """Collective over the instance's group: `node_publish.publish_by_node`."""
    assert _state.identity is not None
    assert _state.settings is not None
    settings = _state.settings
    try:
        share = node_publish.publish_by_node(
            lambda: common.client(settings),
            _state.identity,
            lambda: agent_item(connector, config),
            rank=_state.rank,
            node=_state.node,
            group=_state.group,
            ttl_s=settings.ttl_s,
            logger=log,
        )
    except EngineIdentityError as exc:
        raise RuntimeError(
            f"engine-registry: rank {_state.rank} of group {_state.group_id!r} could "
            f"not be registered: {exc}"
        ) from exc
    atexit.register(share.close)
    if share.batch is not None:
        log.info(
            "engine-registry: node %s registered ranks %s of engine %s in one request "
            "(lease %d s, one heartbeat every %.1f s for the node)",
            share.node,
            share.ranks,
            _state.identity.engine_id,
            settings.ttl_s,
            share.batch.interval_s,
        )
    else:
        log.info(
            "engine-registry: rank %d registered by node %s's leader, rank %d",
            _state.rank,
            share.node,
            share.leader,
        )
    return share


def attach_publication(connector: Any, config: Any) -> None:
    """Publish this rank's agent once its KV caches are registered with the connector."""
    if _state.identity is None or _state.publication is not None:
        return
    register_kv_caches = connector.register_kv_caches
    shutdown = getattr(connector, "shutdown", None)

    def register_then_publish(*args: Any, **kwargs: Any) -> Any:
        result = register_kv_caches(*args, **kwargs)
        if _state.publication is None:
            _state.publication = publish(connector, config)
        return result

    def deregister_then_shutdown(*args: Any, **kwargs: Any) -> Any:
        if _state.publication is not None:
            _state.publication.close()
        return shutdown(*args, **kwargs) if shutdown is not None else None

    connector.register_kv_caches = register_then_publish
    settings = _state.settings
    if settings is not None:
        kv_watch.attach(connector, kv_watch.KvWatch(warn_s=settings.kv_wait_warn_s))
        worker = getattr(connector, "connector_worker", None)
        decoding = worker is not None and common.role(config, settings) != "prefill"
        if decoding and mooncake.is_mooncake(config):
            mooncake.attach_decode(worker, settings)
        elif decoding:
            side = via_registry.DecodeSide(
                tp_size=_state.size,
                rank=_state.rank,
                compat=_state.compat,
                group_id=_state.group_id,
                engine_id=_state.engine_id,
            )
            attached = _state.pp_size == 1 and attach_decode_side(worker, settings, side)
            if not attached and settings.check_remote:
                stale.guard(worker, settings)
    if shutdown is not None:
        connector.shutdown = deregister_then_shutdown
