"""``engine-registry router-sync``: keep running routers in step with the registry.

It follows the registry's watch stream (``GET /tp-groups?watch=true``, through
`workers.watch`: a list first, then every change, across replicas) and, every ``interval_s``,
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
`app.router_feed`'s; the retries of the watch, `workers.backoff.Backoff`'s. smg gateways are
fed through their worker API instead (`app.router_smg`: register, withdraw by DELETE, one round
at once on each change of the registry).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from app.compat import mismatches
from app.router_feed import ROUTER_EXPIRY_S, VllmRouter, announce
from app.router_sight import Sight

if TYPE_CHECKING:
    from app.router_smg import Smg
    from workers.backoff import Backoff

log = logging.getLogger("engine_registry.router_sync")

DECODING = ("decode", "both")
DEFAULT_GRACE_S = 30.0  # blind this long, offer nothing (the workers' default lease ttl)


@dataclass(frozen=True)
class Offered:
    """One instance as a router is told it."""

    group_id: str
    engine_id: str
    generation: int
    kind: str  # "P" (prefill) or "D" (decode)
    http_address: str
    zmq_address: str

    def message(self) -> dict[str, str]:
        return {
            "type": self.kind,
            "http_address": self.http_address,
            "zmq_address": self.zmq_address,
        }

    def packed(self) -> bytes:
        import msgpack

        return bytes(msgpack.packb(self.message()))

    def describe(self) -> str:
        role = "prefill" if self.kind == "P" else "decode"
        return (
            f"{role} {self.group_id} (generation {self.generation}, engine "
            f"{self.engine_id[:8]}) at {self.http_address}"
        )


def _address(url: str, schemes: Sequence[str] = ("http",)) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname or parts.port is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def offer(
    engines: Iterable[Any], model: str | None = None, schemes: Sequence[str] = ("http",)
) -> tuple[list[Offered], dict[str, str]]:
    """(what routers are told, why each other published group is not: group -> cause).

    ``engines``: `workers.models.Engine` objects (their ``raw`` carries ``serving``);
    ``schemes``: the URL schemes the router speaks (smg's feed adds ``grpc``)."""
    left_out: dict[str, str] = {}
    serving: list[tuple[Any, dict[str, Any]]] = []
    for engine in sorted(engines, key=lambda e: (e.created_at, e.group_id)):
        published = (engine.raw or {}).get("serving")
        if not published:
            continue
        if not engine.ready:
            left_out[engine.group_id] = f"not ready (missing ranks {engine.missing_ranks})"
        elif _address(str(published["url"]), schemes) is None:
            left_out[engine.group_id] = (
                f"url {published['url']!r} is not {'|'.join(schemes)}://host:port"
            )
        else:
            serving.append((engine, published))
    if model is None:  # the oldest decode instance's
        model = next((str(s["model"]) for e, s in serving if e.role in DECODING), None)
    kept: list[tuple[Any, dict[str, Any]]] = []
    for engine, published in serving:
        if model is not None and published["model"] != model:
            left_out[engine.group_id] = f"serves model {published['model']!r}, not {model!r}"
        else:
            kept.append((engine, published))
    decode_pool = [e for e, _ in kept if e.role in DECODING]
    anchor = decode_pool[0] if decode_pool else None
    decodes_ok = [d for d in decode_pool if anchor is None or not _differ(d, [anchor])]
    # A prefill is checked against each distinct compat of the offered decodes, not against
    # each decode: a fleet is a few compat classes, and one per decode made a round of
    # 2,500 instances take 4.6 s (longer than the router's 5 s expiry) on a loaded machine.
    classes = list({_compat_key(d.compat): d for d in reversed(decodes_ok)}.values())
    offered: list[Offered] = []
    for engine, published in kept:
        if engine.role == "prefill" and not decodes_ok:
            left_out[engine.group_id] = "no decode instance to pair with"
            continue
        differ = _differ(engine, [anchor] if engine.role == "decode" else classes)
        if differ:
            left_out[engine.group_id] = "incompatible: " + "; ".join(differ[:3])
            continue
        address = _address(str(published["url"]), schemes)
        assert address is not None
        bootstrap = str(published.get("bootstrap") or address)
        kinds = {"prefill": "P", "decode": "D", "both": "PD"}[engine.role]
        for kind in kinds:
            offered.append(
                Offered(
                    engine.group_id, engine.engine_id, engine.generation, kind, address, bootstrap
                )
            )
    return offered, left_out


def _compat_key(compat: dict[str, Any]) -> str:
    """Equal for compats no field of which differs (JSON keeps 1, 1.0 and true apart)."""
    return json.dumps(compat, sort_keys=True, default=str)


def _differ(engine: Any, others: Iterable[Any]) -> list[str]:
    """Each compat field ``engine`` differs in from ``others`` (the handshake's rule)."""
    return [
        f"{m['field']} {m['remote']!r} vs {m['local']!r} of {other.group_id}"
        for other in others
        if other is not None and other is not engine
        for m in mismatches(engine.compat, other.compat)
    ]


class Groups:
    """The registry's groups as the watch last said them, shared with the announcing loop,
    and when the watch last heard from a registry (a change, a list or a bookmark)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()
        self.engines: dict[str, Any] = {}
        self.synced = threading.Event()
        self.version = 0
        self.changed = threading.Event()  # set by each event: a round runs at once (smg)
        self.revision = 0
        self.clock = clock
        self.heard = clock()
        self.cause = ""  # why the watch last failed ("" since it last heard something)

    def apply(self, event: Any) -> None:
        with self.lock:
            self.heard, self.cause = self.clock(), ""
            self.revision = event.revision
            self.version += event.type != "BOOKMARK"  # the groups changed
            if event.type == "SYNC":
                self.engines = {e.group_id: e for e in event.groups}
                self.synced.set()
            elif event.type == "DELETED" and event.engine is not None:
                self.engines.pop(event.engine.group_id, None)
            elif event.engine is not None:
                self.engines[event.engine.group_id] = event.engine
        self.changed.set()

    def failed(self, cause: str) -> None:
        with self.lock:
            self.cause = cause

    def blind(self) -> tuple[float, str]:
        """(seconds since the watch last heard from a registry, the last failure's cause)."""
        with self.lock:
            return self.clock() - self.heard, self.cause

    def snapshot(self) -> list[Any]:
        return self.versioned()[1]

    def versioned(self) -> tuple[int, list[Any]]:
        with self.lock:
            return self.version, list(self.engines.values())


def follow(
    client: Any,
    groups: Groups,
    stop: threading.Event,
    backoff: Backoff | None = None,
    lost_after_s: float = 30.0,
) -> None:
    """Keep ``groups`` as the registry says (its own thread); a failed watch is retried after
    a `Backoff` pause (full jitter, capped; at least a ``Retry-After`` the error carries).
    ``lost_after_s``: no replica answering this long ends a watch with the cause (below the
    grace, so that the line saying router-sync is blind names it)."""
    from workers.backoff import Backoff
    from workers.errors import RegistryUnavailable

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
            log.warning(
                "router-sync: %s; retrying (routers keep the last list within the grace)", exc
            )
        except Exception as exc:  # a refusal (token rotated) or a bad answer: said, retried
            groups.failed(repr(exc))
            retry_after = _retry_after(exc)
            log.error(
                "router-sync: the watch failed (%r); retrying (routers keep the last list "
                "within the grace)",
                exc,
            )
        stop.wait(backoff.next(retry_after))


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
    worker API (`app.router_smg`); a round runs at once on each change of the registry."""
    import zmq

    from app.router_smg import SmgFeeds

    context = zmq.Context()
    routers = [VllmRouter(address, context) for address in router_addresses]
    groups = Groups()
    lost_after_s = min(30.0, grace_s / 2)
    watcher = threading.Thread(
        target=follow,
        args=(client, groups, stop, None, lost_after_s),
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
