"""``engine-registry router-sync``: keep running routers in step with the registry.

It follows the registry's watch stream (``GET /tp-groups?watch=true``, through
`registry_client.watch`: a list first, then every change, across replicas) and, every
``interval_s``,
tells each router the instances it may use. vllm-router (``--vllm-pd-disaggregation
--vllm-discovery-address HOST:PORT``) learns instances from msgpack maps ``{"type": "P"|"D",
"http_address": "host:port", "zmq_address": "host:port"}`` sent to that address over a ZMQ
DEALER socket, and forgets one it has not heard of for 5 s: so an instance the registry stops
offering (superseded, deleted, its ranks' leases lapsed, withdrawn) leaves the router within
about 5 s of the change, and a restarted router has the whole list within one interval.

What is offered (`offer`): engines that are ready and published where they serve, of one
model (``--model``, else the oldest decode instance's); decode instances compatible with the
oldest one; prefill instances compatible with every offered decode (the registry's compat
rule, as its handshake applies it), and none while no decode is offered. Every instance
left out is logged once with its cause.
While the watch is blind (no registry answers, or it refuses the token), the routers keep
being told the last list for ``grace_s`` (`--grace`); past it nothing is offered, so the routers
forget every instance within their 5 s expiry, ``alive_file`` is no longer touched (its probe
fails), and one line says so with the cause. The watch coming back ends it. The sends are
`registry_client.router_sync.vllm_router`'s; the retries of the watch,
`registry_client.backoff.Backoff`'s. smg gateways are
fed through their worker API instead (`registry_client.router_sync.smg`: register, withdraw by
DELETE, one round
at once on each change of the registry).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry_client.router_sync.offers import Groups, Offered, offer
from registry_client.router_sync.sight import Sight
from registry_client.router_sync.vllm_router import ROUTER_EXPIRY_S, VllmRouter, announce

if TYPE_CHECKING:
    from registry_client.backoff import Backoff
    from registry_client.router_sync.smg import Smg

log = logging.getLogger("engine_registry.router_sync")

DEFAULT_GRACE_S = 30.0  # blind this long, offer nothing (the workers' default lease ttl)


def follow(
    client: Any,
    groups: Groups,
    stop: threading.Event,
    backoff: Backoff | None = None,
    lost_after_s: float = 30.0,
    grace_s: float = DEFAULT_GRACE_S,
) -> None:
    """Keep ``groups`` as the registry says (its own thread); a failed watch is retried after
    a `Backoff` pause (full jitter, capped; at least a ``Retry-After`` the error carries).
    ``lost_after_s``: no replica answering this long ends a watch with the cause (below the
    grace, so that the line saying router-sync is blind names it); ``grace_s``: what each
    failure's line says the routers keep."""
    from registry_client.backoff import Backoff
    from registry_client.errors import RegistryUnavailable

    backoff = backoff or Backoff(base_s=0.5, cap_s=10.0)
    while not stop.is_set():
        retry_after: float | None = None
        try:
            # Bookmarks on: a quiet registry still says it is there (every few seconds).
            watch = client.watch(bookmarks=True, idle_timeout_s=20.0, lost_after_s=lost_after_s)
            for event in watch:
                groups.apply(event)
                backoff.reset()
                if stop.is_set():
                    return
            groups.failed("the watch ended")
        except RegistryUnavailable as exc:
            groups.failed(str(exc))
            log.warning("router-sync: %s; retrying (%s)", exc, _kept(groups, grace_s))
        except Exception as exc:  # a refusal (token rotated) or a bad answer: said, retried
            groups.failed(repr(exc))
            retry_after = _retry_after(exc)
            log.error(
                "router-sync: the watch failed (%r); retrying (%s)", exc, _kept(groups, grace_s)
            )
        stop.wait(backoff.next(retry_after))


def _kept(groups: Groups, grace_s: float) -> str:
    """What the routers get while the watch is blind: the last list within the grace."""
    blind_s = groups.blind()[0]
    if blind_s < grace_s:
        return f"routers keep the last list for {grace_s - blind_s:.0f} s more, the grace"
    return f"blind {blind_s:.0f} s, over the {grace_s:g} s grace: nothing is offered"


def _retry_after(exc: Exception) -> float | None:
    """The server's ``Retry-After`` (seconds) where the error carries one."""
    value = getattr(exc, "retry_after_s", None)
    return float(value) if isinstance(value, int | float) else None


class Announcer:
    """Tells every router the offered instances each round; logs each change of the offer."""

    def __init__(
        self, routers: Sequence[VllmRouter], model: str | None, deadline_s: float = 1.0
    ) -> None:
        self.routers = routers
        self.model = model
        self.deadline_s = deadline_s  # a round's sends take at most this long
        self.offered: dict[tuple[str, str], Offered] = {}
        self.left_out: dict[str, str] = {}
        self.version: int | None = None
        self.packed: list[bytes] = []

    def round(self, engines: Iterable[Any], version: int | None = None) -> None:
        """``version`` (`Groups.versioned`): the groups unchanged since the last round, the
        same list is sent without working it out again (0.8 s at 12,500 instances)."""
        if version is None or version != self.version:
            self.offer(engines)
            self.version = version
        announce(self.routers, self.packed, self.deadline_s)

    def offer(self, engines: Iterable[Any]) -> None:
        offered, left_out = offer(engines, self.model)
        now = {(o.group_id, o.kind): o for o in offered}
        for key, item in now.items():
            before = self.offered.get(key)
            if before is not None and before != item:
                cause = (
                    f"superseded by generation {item.generation}"
                    if before.engine_id != item.engine_id
                    else f"it now serves at {item.http_address}"
                )
                log.warning("router-sync: withdraw %s: %s", before.describe(), cause)
            if before != item:
                log.warning("router-sync: offer %s", item.describe())
        for key, item in self.offered.items():
            if key not in now:
                cause = left_out.get(item.group_id, "no longer in the registry as serving")
                log.warning("router-sync: withdraw %s: %s", item.describe(), cause)
        for gid, cause in left_out.items():
            if self.left_out.get(gid) != cause and not any(k[0] == gid for k in self.offered):
                log.warning("router-sync: not offering %s: %s", gid, cause)
        self.offered, self.left_out = now, left_out
        self.packed = [o.packed() for o in offered]


def run(
    client: Any,
    router_addresses: Sequence[str],
    *,
    model: str | None,
    interval_s: float,
    stop: threading.Event,
    alive_file: Path | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    smgs: Sequence[Smg] = (),
) -> int:
    """Follow the registry and feed the routers until ``stop``; 0 then. ``alive_file``:
    touched after each round once synced with the registry, while not blind past
    ``grace_s`` (an exec probe reads its age). ``smgs``: smg gateways fed through their
    worker API (`registry_client.router_sync.smg`); a round runs at once on each change of the
    registry."""
    import zmq

    from registry_client.router_sync.smg import SmgFeeds

    context = zmq.Context()
    routers = [VllmRouter(address, context) for address in router_addresses]
    groups = Groups()
    lost_after_s = min(30.0, grace_s / 2)
    watcher = threading.Thread(
        target=follow,
        args=(client, groups, stop, None, lost_after_s, grace_s),
        name="router-sync-watch",
        daemon=True,
    )
    watcher.start()
    announcer = Announcer(routers, model, deadline_s=interval_s)
    feeds = SmgFeeds(smgs, model)
    sight = Sight(grace_s, alive_file)
    names = [f"vllm-router {a}" for a in router_addresses] + [f"smg {s.url}" for s in smgs]
    log.warning(
        "router-sync: following %s for %s (every %.1f s, grace %g s)",
        client.url,
        ", ".join(names),
        interval_s,
        grace_s,
    )
    try:
        while not stop.is_set():
            started = time.monotonic()
            groups.changed.clear()
            if groups.synced.is_set():
                vouches = sight.vouches(groups, len(announcer.offered))
                if vouches and routers:
                    version, engines = groups.versioned()
                    announcer.round(engines, version)
                if smgs:
                    blind = "" if vouches else "router-sync is blind past its grace"
                    feeds.round(groups.snapshot() if vouches else None, blind)
                if vouches:
                    sight.alive()
            left = max(0.0, interval_s - (time.monotonic() - started))
            if not smgs:
                stop.wait(left)
            elif groups.changed.wait(left):  # a change: the next round at once (a burst: one)
                stop.wait(0.05)
    finally:
        feeds.close()
        for router in routers:
            router.close()
        context.term()
    return 0


__all__ = [
    "DEFAULT_GRACE_S",
    "ROUTER_EXPIRY_S",
    "Announcer",
    "Groups",
    "Offered",
    "Sight",
    "VllmRouter",
    "offer",
    "run",
]
