"""Agents published to the registry and kept alive under their leases.

Two ways, one heartbeat loop (`LeaseKeeper`):

- `Publication`: one rank publishes its own agent (`PUT .../agents/{rank}`) and renews it
  (`POST .../agents/{rank}/heartbeat`): one registration and one heartbeat stream per rank.
- `BatchPublication`: one process publishes several ranks' agents (a node's, gathered by its
  leader) in one request and one transaction (`PUT .../agents`, one shared lease, all or
  none) and renews them with one heartbeat (`POST .../agents/heartbeat`).

Both renew over the registry's keep-alive stream (`GET /keepalive`, `workers.keepalive`: one
WebSocket, one small message per renewal, the same answers) while it serves one, and over
the REST heartbeat when it refuses the stream (an older registry) or the stream breaks.

The loop's rules are the same for both: a heartbeat every `ttl_s * fraction` seconds; after a
404 (a lease expired, say after a registry outage) register again; after a 409 (a newer
launch superseded the engine) stop, log loudly, set `superseded` and call `on_superseded`:
a rank of an old launch must not keep serving under an id the registry no longer vouches for.
Any other failure (the registry unreachable, a 503) is logged and the next heartbeat tries
again sooner than the interval, after a pause of `registry_client.backoff` (full jitter from 1 s,
doubling up to the interval, at least the registry's `Retry-After`), so that the nodes of a
fleet that lost their registry come back spread out: an outage shorter than the lease costs
nothing, and a longer one ends in a 404 and a new registration. The client retries each call
within its deadline (the interval), paced the same way.

Used by the `torchrun` entrypoints (`workers.launch`, `workers.node`) and by the vLLM plugin
(`workers.vllm_plugin.worker_side`). Imports neither torch nor numpy (a test checks): the
plugin's scheduler process and the tools use it without them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from registry_client.backoff import Backoff
from registry_client.client import RegistryClient
from registry_client.errors import EngineIdMismatch, NotFound, RegistryError
from registry_client.models import AgentItem, EngineIdentity, KvSpec
from workers.keepalive import KeepAliveStream

log = logging.getLogger(__name__)


def verdict_of(exc: Exception) -> tuple[str, str]:
    """A publication failure as an agreed verdict's (cause, detail)."""
    if isinstance(exc, EngineIdMismatch):
        return f"registry_refused:{exc.cause}", exc.detail or str(exc)
    if isinstance(exc, RegistryError):
        return "registry_refused", str(exc)
    log.error("publishing the agent failed", exc_info=exc)
    return "publish_failed", repr(exc)


@dataclass(frozen=True)
class LocalFailure:
    """Why a rank could not describe its agent; gathered to the leader instead of an item."""

    rank: int
    cause: str
    detail: str


class LeaseKeeper:
    """The heartbeat loop: subclasses say how to publish, renew and deregister."""

    def __init__(
        self,
        make_client: Callable[[], RegistryClient],
        identity: EngineIdentity,
        *,
        label: str,
        ttl_s: int = 30,
        fraction: float = 1 / 3,
        on_superseded: Callable[[EngineIdMismatch], None] | None = None,
        logger: logging.Logger | None = None,
        close_timeout_s: float = 5.0,
        wait: Callable[[float], bool] | None = None,
        keepalive: bool = True,
    ) -> None:
        """`wait(seconds)`: sleep between heartbeats, True when the keeper is stopping
        (default: the stop event's own wait; tests pass a fake clock's). `keepalive`: renew
        over the registry's keep-alive stream while it serves one (`workers.keepalive`)."""
        self._client = make_client()
        self._hb_client = make_client()  # one httpx client per thread
        self.stream = KeepAliveStream(self._hb_client, logger=logger) if keepalive else None
        self.identity = identity
        self.label = label
        self.ttl_s = ttl_s
        self.interval_s = max(0.2, ttl_s * fraction)
        self._backoff = Backoff(base_s=min(1.0, self.interval_s), cap_s=self.interval_s)
        self.pause_s = self.interval_s  # until the next heartbeat
        self.on_superseded = on_superseded
        self.superseded = threading.Event()
        self.reregistrations = 0
        self.heartbeats = 0
        self.failures = 0
        self.published = False
        self.log = logger or log
        self.close_timeout_s = close_timeout_s
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- what differs -----------------------------------------------------------------------

    def publish(self, client: RegistryClient | None = None) -> bool:
        """Register; True when some rank had no live agent. Raises the registry's error."""
        raise NotImplementedError

    def _renew(self, client: RegistryClient, timeout_s: float) -> None:
        """One renewal of the keeper's ranks: over the keep-alive stream while there is one,
        else the REST heartbeat (`_rest_renew`)."""
        stream, identity = self.stream, self.identity
        ranks = self._ranks()
        if stream is None or (
            stream.renew(identity.group_id, identity.engine_id, ranks, timeout_s) is None
        ):
            self._rest_renew(client, timeout_s)

    def _ranks(self) -> list[int]:
        raise NotImplementedError

    def _rest_renew(self, client: RegistryClient, timeout_s: float) -> None:
        raise NotImplementedError

    def _deregister(self, client: RegistryClient, timeout_s: float) -> None:
        raise NotImplementedError

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        name = f"heartbeat-{self.label.replace(' ', '')}"
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def run(self) -> None:
        """The loop, in the caller's thread (`start()` runs it in its own)."""
        while not self._wait(self.pause_s):
            if not self.beat():
                return

    def beat(self) -> bool:
        """One heartbeat and what follows from its answer; False once superseded."""
        log, client = self.log, self._hb_client
        try:
            self._renew(client, self.interval_s)
            self.heartbeats += 1
            self._backoff.reset()
            self.pause_s = self.interval_s
        except NotFound as exc:
            log.warning("%s: agent lease gone (404: %s); registering again", self.label, exc.detail)
            self.pause_s = self.interval_s
            try:
                self.publish(client)
                self.reregistrations += 1
            except RegistryError as again:
                log.warning("%s: re-registration failed: %s", self.label, again)
        except EngineIdMismatch as exc:
            log.error(
                "%s OF ENGINE %s IS SUPERSEDED (%s): a newer launch of group %s owns "
                "it now. Heartbeats stop; the rank(s) must shut down.",
                self.label.upper(),
                self.identity.engine_id,
                exc.detail,
                self.identity.group_id,
            )
            self.superseded.set()
            if self.on_superseded is not None:
                self.on_superseded(exc)
            return False
        except RegistryError as exc:
            # Keep trying: a registry outage shorter than the lease costs nothing.
            self.failures += 1
            self.pause_s = self._backoff.next(client.last_retry_after_s)
            log.warning(
                "%s: heartbeat failed: %s; next try in %.1f s", self.label, exc, self.pause_s
            )
        return True

    def close(self, *, deregister: bool = True) -> None:
        """Stop the heartbeat and (unless superseded) deregister. Idempotent, bounded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
        if self._closed:
            return
        self._closed = True
        if deregister and self.published and not self.superseded.is_set():
            try:
                self._deregister(self._client, self.close_timeout_s)
            except RegistryError as exc:
                self.log.warning("%s: deregistration failed: %s", self.label, exc)
        if self.stream is not None:
            self.stream.close()
        self._client.close()
        self._hb_client.close()


class Publication(LeaseKeeper):
    """A rank's own agent registration, kept alive by its own heartbeat (per-rank routes)."""

    def __init__(
        self,
        make_client: Callable[[], RegistryClient],
        identity: EngineIdentity,
        rank: int,
        *,
        agent_name: str,
        metadata: bytes,
        host: str,
        kv: KvSpec,
        ttl_s: int = 30,
        fraction: float = 1 / 3,
        on_superseded: Callable[[EngineIdMismatch], None] | None = None,
        logger: logging.Logger | None = None,
        close_timeout_s: float = 5.0,
        wait: Callable[[float], bool] | None = None,
        keepalive: bool = True,
    ) -> None:
        super().__init__(
            make_client,
            identity,
            label=f"rank {rank}",
            ttl_s=ttl_s,
            fraction=fraction,
            on_superseded=on_superseded,
            logger=logger,
            close_timeout_s=close_timeout_s,
            wait=wait,
            keepalive=keepalive,
        )
        self.rank = rank
        self.agent_name = agent_name
        self._metadata = metadata
        self.host = host
        self.kv = kv

    def publish(self, client: RegistryClient | None = None) -> bool:
        _, created = (client or self._client).register_agent(
            self.identity.group_id,
            self.rank,
            engine_id=self.identity.engine_id,
            agent_name=self.agent_name,
            agent_metadata=self._metadata,
            host=self.host,
            kv=self.kv,
            ttl_s=self.ttl_s,
        )
        self.published = True
        return created

    def _ranks(self) -> list[int]:
        return [self.rank]

    def _rest_renew(self, client: RegistryClient, timeout_s: float) -> None:
        client.heartbeat(
            self.identity.group_id,
            self.rank,
            engine_id=self.identity.engine_id,
            timeout_s=timeout_s,
        )

    def _deregister(self, client: RegistryClient, timeout_s: float) -> None:
        client.deregister_agent(
            self.identity.group_id,
            self.rank,
            engine_id=self.identity.engine_id,
            timeout_s=timeout_s,
        )


class BatchPublication(LeaseKeeper):
    """Several ranks' agents (a node's) registered in one request on one shared lease and
    renewed by one heartbeat (batch routes). Deregistration is per rank: the contract has
    no batch DELETE, and a lease shared with a deregistered rank lives on for the others."""

    def __init__(
        self,
        make_client: Callable[[], RegistryClient],
        identity: EngineIdentity,
        agents: Sequence[AgentItem],
        *,
        label: str | None = None,
        ttl_s: int = 30,
        fraction: float = 1 / 3,
        on_superseded: Callable[[EngineIdMismatch], None] | None = None,
        logger: logging.Logger | None = None,
        close_timeout_s: float = 5.0,
        wait: Callable[[float], bool] | None = None,
        keepalive: bool = True,
    ) -> None:
        if not agents:
            raise ValueError("a batch publication needs at least one agent")
        wrong = [a.rank for a in agents if a.engine_id != identity.engine_id]
        if wrong:
            raise ValueError(f"ranks {wrong} carry another engine_id than {identity.engine_id}")
        self.agents = sorted(agents, key=lambda a: a.rank)
        self.ranks = [a.rank for a in self.agents]
        super().__init__(
            make_client,
            identity,
            label=label or f"ranks {self.ranks}",
            ttl_s=ttl_s,
            fraction=fraction,
            on_superseded=on_superseded,
            logger=logger,
            close_timeout_s=close_timeout_s,
            wait=wait,
            keepalive=keepalive,
        )

    def publish(self, client: RegistryClient | None = None) -> bool:
        answer = (client or self._client).register_agents(
            self.identity.group_id, self.agents, ttl_s=self.ttl_s
        )
        self.published = True
        return bool(answer.created_ranks)

    def _ranks(self) -> list[int]:
        return self.ranks

    def _rest_renew(self, client: RegistryClient, timeout_s: float) -> None:
        client.heartbeat_agents(
            self.identity.group_id,
            engine_id=self.identity.engine_id,
            ranks=self.ranks,
            timeout_s=timeout_s,
        )

    def _deregister(self, client: RegistryClient, timeout_s: float) -> None:
        failed: list[str] = []
        for rank in self.ranks:
            try:
                client.deregister_agent(
                    self.identity.group_id,
                    rank,
                    engine_id=self.identity.engine_id,
                    timeout_s=timeout_s,
                )
            except NotFound:
                pass  # already gone: what deregistering wants
            except RegistryError as exc:
                failed.append(f"rank {rank}: {exc}")
        if failed:
            log.warning("%s: deregistration failed for %s", self.label, "; ".join(failed))
