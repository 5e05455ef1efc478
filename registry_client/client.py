"""A typed, synchronous client for the registry's REST contract (docs/api.md).

Policy, in one place:

- Every call has a deadline (`timeout_s`, default the client's). Each HTTP attempt gets what is
  left of it, so no call outlives its deadline by more than a connect timeout's rounding.
- Connection errors, 503 and 429 answers are retried until the deadline, paced by
  `registry_client.backoff` (capped exponential, full jitter, a `Retry-After` a floor); other 4xx
  answers never are (they are facts, not weather). Every request of the
  contract is retry-safe (API.md "Retry-safe"), so a retried write cannot open twice.
- Several registry URLs (replicas) may be given: a failed attempt moves to the next one at
  once, backoff sleeps only after a full round; the last URL that answered is tried first.
- Error answers become the `ProblemError` subclass named by their `code`.
- `https://` URLs are verified (`tls`: a `registry_client.tls.ClientTLS`, else the system trust
  store); a TLS failure that retrying cannot fix is not retried: once every replica has
  failed so, `RegistryTLSError` is raised (at once with one URL).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from registry_client.backoff import Backoff
from registry_client.models import (
    AgentItem,
    AgentRecord,
    BatchRegistration,
    Compat,
    Engine,
    Handshake,
    KvSpec,
    RankExpiry,
    Role,
)
from registry_client.paths import engine_path, group_path, rank_segment
from registry_client.transport import (
    HOLD_MARGIN_S,
    ReplicaTransport,
)
from registry_client.watch import AsyncGroupWatch, GroupWatch


class RegistryClient(ReplicaTransport):
    """Client for one registry (any number of replicas of it): the contract's calls."""

    # -- engines --------------------------------------------------------------------------

    def open_engine(
        self,
        group_id: str,
        *,
        launch_id: str,
        tp_size: int,
        role: Role,
        compat: Compat | None = None,
        timeout_s: float | None = None,
    ) -> tuple[Engine, bool]:
        """Open (or re-open, same launch_id) the group's engine; `True` when newly opened."""
        body: dict[str, Any] = {"launch_id": launch_id, "tp_size": tp_size, "role": role}
        if compat is not None:
            body["compat"] = compat
        r = self.request("PUT", f"{group_path(group_id)}/engine", json=body, timeout_s=timeout_s)
        return Engine.from_json(r.json()), r.status_code == 201

    def get_engine(
        self, group_id: str, *, wait_ready_s: float | None = None, timeout_s: float | None = None
    ) -> Engine:
        params: dict[str, Any] | None = None
        hold = 0.0
        if wait_ready_s is not None:
            params = {"wait_ready": wait_ready_s}
            hold = wait_ready_s + HOLD_MARGIN_S
        r = self.request(
            "GET", f"{group_path(group_id)}/engine", params=params, timeout_s=timeout_s, hold_s=hold
        )
        return Engine.from_json(r.json())

    def list_groups(self, *, timeout_s: float | None = None) -> list[Engine]:
        r = self.request("GET", "/tp-groups", timeout_s=timeout_s)
        return [Engine.from_json(g) for g in r.json()["groups"]]

    def watch(
        self,
        *,
        revision: int | None = None,
        role: Role | None = None,
        model: str | None = None,
        bookmarks: bool = False,
        idle_timeout_s: float = 20.0,
        lost_after_s: float = 30.0,
        backoff: Backoff | None = None,
    ) -> GroupWatch:
        """Every change of every group, as it lands (`registry_client.watch`): a `SYNC` of the
        groups
        first (unless started at `revision`), then each change once, in order, across
        replicas and relists; `WatchLost` when no replica answers for `lost_after_s`.
        `role`/`model`: the server's filters (a group leaving them comes as `DELETED`);
        `backoff`: the pauses between tries (default `registry_client.watch`'s)."""
        return GroupWatch(
            self,
            revision=revision,
            role=role,
            model=model,
            bookmarks=bookmarks,
            idle_timeout_s=idle_timeout_s,
            lost_after_s=lost_after_s,
            backoff=backoff,
        )

    def awatch(
        self,
        *,
        revision: int | None = None,
        role: Role | None = None,
        model: str | None = None,
        bookmarks: bool = False,
        idle_timeout_s: float = 20.0,
        lost_after_s: float = 30.0,
        backoff: Backoff | None = None,
    ) -> AsyncGroupWatch:
        """`watch`, as an asynchronous iterator."""
        return AsyncGroupWatch(
            self,
            revision=revision,
            role=role,
            model=model,
            bookmarks=bookmarks,
            idle_timeout_s=idle_timeout_s,
            lost_after_s=lost_after_s,
            backoff=backoff,
        )

    def delete_group(self, group_id: str, *, timeout_s: float | None = None) -> None:
        self.request("DELETE", group_path(group_id), timeout_s=timeout_s)

    def resolve_engine(self, engine_id: str, *, timeout_s: float | None = None) -> Engine:
        r = self.request("GET", engine_path(engine_id), timeout_s=timeout_s)
        return Engine.from_json(r.json())

    # -- agents ---------------------------------------------------------------------------

    def register_agent(
        self,
        group_id: str,
        rank: int,
        *,
        engine_id: str,
        agent_name: str,
        agent_metadata: bytes,
        host: str,
        kv: KvSpec,
        ttl_s: int | None = None,
        timeout_s: float | None = None,
    ) -> tuple[AgentRecord, bool]:
        """Publish a rank's NIXL agent; `True` when the rank had no live agent before."""
        body: dict[str, Any] = {
            "engine_id": engine_id,
            "agent_name": agent_name,
            "agent_metadata": base64.b64encode(agent_metadata).decode("ascii"),
            "host": host,
            "kv": kv.to_json(),
        }
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        r = self.request(
            "PUT",
            f"{group_path(group_id)}/engine/agents/{rank_segment(rank)}",
            json=body,
            timeout_s=timeout_s,
        )
        return AgentRecord.from_json(r.json()), r.status_code == 201

    def heartbeat(
        self, group_id: str, rank: int, *, engine_id: str, timeout_s: float | None = None
    ) -> str:
        """Renew the lease; returns the new `expires_at`."""
        r = self.request(
            "POST",
            f"{group_path(group_id)}/engine/agents/{rank_segment(rank)}/heartbeat",
            json={"engine_id": engine_id},
            timeout_s=timeout_s,
        )
        return str(r.json().get("expires_at", ""))

    def register_agents(
        self,
        group_id: str,
        agents: Sequence[AgentItem],
        *,
        ttl_s: int | None = None,
        timeout_s: float | None = None,
    ) -> BatchRegistration:
        """Publish several ranks' agents in one request and one transaction, on one shared
        lease: all or none. A refusal names the first bad rank (`EngineIdMismatch.rank`,
        or the `loc` of an `InvalidRequest` error)."""
        if not agents:
            raise ValueError("a batch registration needs at least one agent")
        body = {"agents": [agent.to_json(ttl_s) for agent in agents]}
        r = self.request(
            "PUT", f"{group_path(group_id)}/engine/agents", json=body, timeout_s=timeout_s
        )
        return BatchRegistration.from_json(r.json())

    def heartbeat_agents(
        self,
        group_id: str,
        *,
        engine_id: str,
        ranks: Sequence[int],
        timeout_s: float | None = None,
    ) -> list[RankExpiry]:
        """Renew the leases of `ranks` in one request; `NotFound` names the first rank with
        no live agent (register it again), `EngineIdMismatch` a superseded engine."""
        if not ranks:
            raise ValueError("a batch heartbeat needs at least one rank")
        r = self.request(
            "POST",
            f"{group_path(group_id)}/engine/agents/heartbeat",
            json={"engine_id": engine_id, "ranks": list(ranks)},
            timeout_s=timeout_s,
        )
        return [RankExpiry.from_json(a) for a in r.json()["agents"]]

    def deregister_agent(
        self, group_id: str, rank: int, *, engine_id: str, timeout_s: float | None = None
    ) -> None:
        self.request(
            "DELETE",
            f"{group_path(group_id)}/engine/agents/{rank_segment(rank)}",
            params={"engine_id": engine_id},
            timeout_s=timeout_s,
        )

    # -- decode side ----------------------------------------------------------------------

    def handshake(
        self,
        engine_id: str,
        *,
        tp_size: int,
        rank: int,
        compat: Compat | None = None,
        decode: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Handshake:
        """What this decode rank loads; ``decode`` (``group_id``, ``engine_id``) names the
        asking side in the registry's handshake event."""
        body: dict[str, Any] = {"tp_size": tp_size, "rank": rank}
        if compat is not None:
            body["compat"] = compat
        if decode is not None:
            body["decode"] = dict(decode)
        r = self.request(
            "POST", f"{engine_path(engine_id)}/handshake", json=body, timeout_s=timeout_s
        )
        return Handshake.from_json(r.json())

    # -- health ---------------------------------------------------------------------------

    def healthz(self, *, timeout_s: float | None = None) -> bool:
        self.request("GET", "/healthz", timeout_s=timeout_s)
        return True

    def readyz(self, *, timeout_s: float | None = None) -> bool:
        self.request("GET", "/readyz", timeout_s=timeout_s)
        return True
