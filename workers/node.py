"""Per-node publication: a node's leader registers every local rank's agent in one request.

How (collective over the TP group; every rank calls `publish_per_node`):

1. All ranks all-gather their node (torchrun's GROUP_RANK) over the CPU group and make one
   gloo subgroup per node (`new_subgroups_by_enumeration`, collective over the world, with the
   group's collective timeout).
2. Each rank gathers its `AgentItem` (or why it could not make one) to its node's leader, the
   node's lowest rank, over the node's subgroup: metadata never crosses nodes.
3. The leader registers the node's ranks with one batch `PUT` and keeps them alive with one
   `BatchPublication` heartbeat; the other ranks never talk to the registry to publish.
4. The caller agrees on the outcome over the whole TP group, as in per-rank mode.

While serving, leader and followers talk through the job's rendezvous store (torchrun's
TCPStore), never in a collective, so no rank blocks in a serving loop:

- a leader superseded (409) writes `superseded`; each follower's watcher sees it within
  `poll_s` and stops its rank the way a superseded per-rank publication would;
- each follower writes `done/<rank>` when it closes; the leader keeps the node's leases alive
  until every follower is done (at most `linger_s`), then deregisters the node's ranks.

If the leader dies, its followers' leases lapse after `ttl_s`; torchrun stops a node's
remaining workers when one fails, so they do not serve unpublished for long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from registry_client.client import RegistryClient
from registry_client.errors import EngineIdentityError, EngineIdMismatch
from registry_client.models import AgentItem
from workers.identity import EngineIdentity, agree
from workers.publication import BatchPublication, LocalFailure, verdict_of

log = logging.getLogger(__name__)


class RankPublication(Protocol):
    """What a serving rank holds of its publication, whichever the mode."""

    host: str
    superseded: threading.Event

    def close(self, *, deregister: bool = True) -> None: ...


def follower_poll_s(ttl_s: float) -> float:
    """How often a follower looks for its leader's verdicts (the leader waits on it)."""
    return max(0.2, ttl_s / 3)


@dataclass(frozen=True)
class NodeGroup:
    node: int
    ranks: list[int]  # global ranks of this node, ascending; ranks[0] leads
    group: Any  # gloo subgroup over `ranks`

    @property
    def leader(self) -> int:
        return self.ranks[0]


def node_groups(node: int, *, cpu_group: Any, timeout_s: float) -> NodeGroup:
    """This rank's node subgroup (collective over the world: every rank calls it).

    `cpu_group` spans the world (the TP group is the world under the entrypoints), so its
    ranks are global ranks, as `gather_object`'s `dst` wants them.
    """
    nodes: list[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(nodes, node, group=cpu_group)
    by_node: dict[int, list[int]] = {}
    for rank, n in enumerate(nodes):
        by_node.setdefault(int(n), []).append(rank)
    partition = [by_node[n] for n in sorted(by_node)]
    if len(partition) == 1:  # one node: the CPU group is the node's group
        return NodeGroup(node, partition[0], cpu_group)
    group, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        partition, timeout=timedelta(seconds=timeout_s), backend="gloo"
    )
    return NodeGroup(node, by_node[node], group)


def gather_items(
    node: NodeGroup, mine: AgentItem | LocalFailure
) -> list[AgentItem | LocalFailure] | None:
    """Every local rank's item on the leader (None elsewhere), bounded by the group timeout."""
    rank = dist.get_rank()
    out: list[Any] | None = [None] * len(node.ranks) if rank == node.leader else None
    dist.gather_object(mine, out, dst=node.leader, group=node.group)
    return out


class NodeSignals:
    """Flags between a node's leader and followers, in the rendezvous store (module doc)."""

    def __init__(self, identity: EngineIdentity, node: int) -> None:
        # The job's rendezvous store (torchrun's TCPStore), which every rank already uses.
        base = c10d._get_default_store()
        prefix = f"workers/publication/{identity.group_id}/{identity.engine_id}/node{node}/"
        self.store = c10d.PrefixStore(prefix, base)

    def set_superseded(self, detail: str) -> None:
        self.store.set("superseded", detail)

    def superseded(self) -> str | None:
        if not self.store.check(["superseded"]):
            return None
        return bytes(self.store.get("superseded")).decode(errors="replace")

    def set_done(self, rank: int) -> None:
        self.store.set(f"done/{rank}", "1")

    def wait_done(self, ranks: list[int], timeout_s: float) -> bool:
        if not ranks:
            return True
        try:
            self.store.wait([f"done/{r}" for r in ranks], timedelta(seconds=max(timeout_s, 0.1)))
        except Exception as exc:  # the store raises its own errors on timeout
            log.warning("followers %s not done after %.0fs (%s)", ranks, timeout_s, exc)
            return False
        return True


class NodeLeader:
    """The leader's side: a `BatchPublication` of the node's ranks plus the node signals."""

    def __init__(
        self,
        make_client: Callable[[], RegistryClient],
        identity: EngineIdentity,
        items: list[AgentItem],
        node: NodeGroup,
        *,
        ttl_s: int,
        linger_s: float,
        on_superseded: Callable[[EngineIdMismatch], None],
    ) -> None:
        self.signals = NodeSignals(identity, node.node)
        self.node = node
        self.linger_s = linger_s
        # How long followers take to see the leader's `superseded` (their watcher's period).
        self.follower_poll_s = follower_poll_s(ttl_s)
        self.host = next(i.host for i in items if i.rank == node.leader)

        def superseded(exc: EngineIdMismatch) -> None:
            try:
                self.signals.set_superseded(exc.detail or str(exc))
            except Exception as err:
                log.error(
                    "could not tell node %d's followers they are superseded: %s", node.node, err
                )
            on_superseded(exc)

        self.batch = BatchPublication(
            make_client,
            identity,
            items,
            label=f"node {node.node} ranks {node.ranks}",
            ttl_s=ttl_s,
            on_superseded=superseded,
        )
        self.superseded = self.batch.superseded

    @property
    def published(self) -> bool:
        return self.batch.published

    def publish(self) -> bool:
        return self.batch.publish()

    def start(self) -> None:
        self.batch.start()

    def close(self, *, deregister: bool = True, wait_followers: bool = True) -> None:
        """Keep the node's leases until its followers are done (bounded), then close.

        Superseded, the leader still gives its followers their watcher's period to see it
        and stop as superseded ranks themselves: leaving at once, it would have torchrun
        SIGTERM them first, and they would stop without knowing why."""
        if wait_followers and self.batch.published:
            if self.superseded.is_set():
                self.signals.wait_done(self.node.ranks[1:], 2 * self.follower_poll_s + 2)
            else:
                self.signals.wait_done(self.node.ranks[1:], self.linger_s)
        self.batch.close(deregister=deregister)


class NodeFollower:
    """A follower's side: no registry traffic, only a watcher for the leader's 409."""

    def __init__(
        self,
        identity: EngineIdentity,
        node: NodeGroup,
        rank: int,
        host: str,
        *,
        poll_s: float,
        on_superseded: Callable[[EngineIdMismatch], None],
    ) -> None:
        self.signals = NodeSignals(identity, node.node)
        self.identity = identity
        self.rank = rank
        self.leader = node.leader
        self.host = host
        self.poll_s = poll_s
        self.on_superseded = on_superseded
        self.superseded = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="node-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                detail = self.signals.superseded()
            except Exception as exc:  # the store went away: the job is ending
                log.warning("rank %d: node signals unreadable (%s); watcher stops", self.rank, exc)
                return
            if detail is None:
                continue
            log.error(
                "RANK %d OF ENGINE %s IS SUPERSEDED (its node's leader, rank %d, was told so: "
                "%s). This rank must shut down.",
                self.rank,
                self.identity.engine_id,
                self.leader,
                detail,
            )
            self.superseded.set()
            problem = {"code": "engine_id_mismatch", "cause": "superseded", "detail": detail}
            self.on_superseded(EngineIdMismatch(problem, status=409))
            return

    def close(self, *, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5)
            self._thread = None
        try:
            self.signals.set_done(self.rank)
        except Exception as exc:
            log.warning("rank %d: could not tell the node leader it is done: %s", self.rank, exc)


def publish_per_node(
    make_client: Callable[[], RegistryClient],
    identity: EngineIdentity,
    mine: AgentItem | LocalFailure,
    *,
    node: int,
    cpu_group: Any,
    collective_timeout_s: float,
    ttl_s: int,
    linger_s: float,
    wanted: bool,
    what: str,
    on_superseded: Callable[[EngineIdMismatch], None],
) -> RankPublication:
    """Steps 1-4 of the module doc; collective over the TP group (`cpu_group`).

    `mine`: this rank's item, or why it could not make one (its verdict); `wanted` is
    False when nothing is to be published (a fallback engine_id no registry knows).
    """
    group = node_groups(node, cpu_group=cpu_group, timeout_s=collective_timeout_s)
    rank = dist.get_rank()
    gathered = gather_items(group, mine)
    leader: NodeLeader | None = None
    ok, cause, detail = True, "", ""
    if isinstance(mine, LocalFailure):
        ok, cause, detail = False, mine.cause, mine.detail
    elif gathered is not None and wanted:
        items = [i for i in gathered if isinstance(i, AgentItem)]
        # A local rank that failed reports its own verdict; the node registers all or none.
        if len(items) == len(gathered):
            try:
                leader = NodeLeader(
                    make_client,
                    identity,
                    items,
                    group,
                    ttl_s=ttl_s,
                    linger_s=linger_s,
                    on_superseded=on_superseded,
                )
                created = leader.publish()
                log.info(
                    "node %d: registered ranks %s in one request (%s)",
                    group.node,
                    group.ranks,
                    "new" if created else "replacing live agents",
                )
            except Exception as exc:
                ok = False
                cause, detail = verdict_of(exc)
    try:
        agree(ok, cause, detail, group=cpu_group, what=what)
    except EngineIdentityError:
        if leader is not None:
            leader.close(deregister=ok, wait_followers=False)
        raise
    if leader is not None:
        if leader.published:
            leader.start()
        return leader
    host = mine.host if isinstance(mine, AgentItem) else ""
    follower = NodeFollower(
        identity, group, rank, host, poll_s=follower_poll_s(ttl_s), on_superseded=on_superseded
    )
    if rank != group.leader and wanted:
        follower.start()
    return follower
