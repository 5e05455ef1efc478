"""One publication per node (the plugin's default, ``ENGINE_REGISTRY_PUBLISH=node``).

Each vLLM worker describes its rank's agent once its KV caches are registered; the ranks of
the instance's TP group (its TP x PP world under pipeline parallelism) all-gather
``(node, item)`` over the group's CPU (gloo) group, and each node's lowest rank registers the
node's agents in one request on one lease and renews them with one heartbeat
(`workers.publication.BatchPublication`, the batched routes the torchrun workers use). The other
ranks of the node make no registry request to publish or renew. Every rank then agrees on the
outcome over the group (`workers.identity.agree`): a rank that could not describe its agent, or
a node whose batch the registry refused, fails the start on every rank, naming rank and cause,
and a node that registered deregisters again.

A node is a host and vLLM's ``--node-rank`` (`common.node_name`): two ``--nnodes`` processes
on one host are two nodes, and under an executor that leaves ``node_rank`` at 0 (Ray) the host
name tells nodes apart. The items cross nodes in the all-gather (a few KiB a
rank, once per launch) so that no extra process group is made inside vLLM's worker.

A node's ranks share their leader's lease: if the leader's process dies the node's agents
lapse with it, which is what vLLM does too (one worker lost stops the instance). A superseded
leader (409) logs it for its node, as a per-rank publication logs it for its rank.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from registry_client.client import RegistryClient
from registry_client.errors import EngineIdentityError
from registry_client.models import AgentItem, EngineIdentity
from workers.identity import agree
from workers.publication import BatchPublication, LocalFailure, verdict_of


@dataclass
class NodeShare:
    """What one rank holds of its node's publication: the leader its batch, the others none."""

    node: str
    rank: int
    ranks: list[int]  # the node's ranks; ranks[0] leads
    batch: BatchPublication | None = None
    superseded: threading.Event = field(default_factory=threading.Event)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def close(self, *, deregister: bool = True) -> None:
        if self.batch is not None:
            self.batch.close(deregister=deregister)


def publish_by_node(
    make_client: Callable[[], RegistryClient],
    identity: EngineIdentity,
    describe: Callable[[], AgentItem],
    *,
    rank: int,
    node: str,
    group: Any,
    ttl_s: int,
    logger: logging.Logger,
    close_timeout_s: float = 2.0,
) -> NodeShare:
    """Collective over `group` (every rank calls it): the module doc's steps.

    Raises `EngineIdentityError` on every rank when any rank or node failed.
    """
    mine: AgentItem | LocalFailure
    try:
        mine = describe()
    except Exception as exc:
        mine = LocalFailure(rank, *verdict_of(exc))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (node, mine), group=group)
    local = sorted((item for key, item in everyone if key == node), key=lambda i: i.rank)
    share = NodeShare(node, rank, [item.rank for item in local])
    ok, cause, detail = True, "", ""
    if isinstance(mine, LocalFailure):
        ok, cause, detail = False, mine.cause, mine.detail
    elif share.leader == rank and all(isinstance(item, AgentItem) for item in local):
        # A local rank that failed says so in its own verdict; the node registers all or none.
        try:
            share.batch = BatchPublication(
                make_client,
                identity,
                local,
                label=f"node {node} ranks {share.ranks}",
                ttl_s=ttl_s,
                logger=logger,
                close_timeout_s=close_timeout_s,
            )
            share.superseded = share.batch.superseded
            share.batch.publish()
        except Exception as exc:
            ok = False
            cause, detail = verdict_of(exc)
    try:
        agree(ok, cause, detail, group=group, what=f"agent registration for {identity.group_id!r}")
    except EngineIdentityError:
        share.close(deregister=ok)
        raise
    if share.batch is not None:
        share.batch.start()
    return share
