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
While no registry answers, the routers keep being told the last list.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.compat import mismatches

log = logging.getLogger("engine_registry.router_sync")

ROUTER_EXPIRY_S = 5.0
DECODING = ("decode", "both")  # vllm-router forgets an instance not announced for this long


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

    def describe(self) -> str:
        role = "prefill" if self.kind == "P" else "decode"
        return (
            f"{role} {self.group_id} (generation {self.generation}, engine "
            f"{self.engine_id[:8]}) at {self.http_address}"
        )


def _address(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def offer(engines: Iterable[Any], model: str | None = None) -> tuple[list[Offered], dict[str, str]]:
    """(what routers are told, why each other published group is not: group -> cause).

    ``engines``: `workers.models.Engine` objects (their ``raw`` carries ``serving``)."""
    left_out: dict[str, str] = {}
    serving: list[tuple[Any, dict[str, Any]]] = []
    for engine in sorted(engines, key=lambda e: (e.created_at, e.group_id)):
        published = (engine.raw or {}).get("serving")
        if not published:
            continue
        if not engine.ready:
            left_out[engine.group_id] = f"not ready (missing ranks {engine.missing_ranks})"
        elif _address(str(published["url"])) is None:
            left_out[engine.group_id] = f"url {published['url']} is not http://host:port"
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
    offered: list[Offered] = []
    for engine, published in kept:
        if engine.role == "prefill" and not decodes_ok:
            left_out[engine.group_id] = "no decode instance to pair with"
            continue
        differ = _differ(engine, [anchor] if engine.role == "decode" else decodes_ok)
        if differ:
            left_out[engine.group_id] = "incompatible: " + "; ".join(differ[:3])
            continue
        address = _address(str(published["url"]))
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


def _differ(engine: Any, others: Iterable[Any]) -> list[str]:
    """Each compat field ``engine`` differs in from ``others`` (the handshake's rule)."""
    return [
        f"{m['field']} {m['remote']!r} vs {m['local']!r} of {other.group_id}"
        for other in others
        if other is not None and other is not engine
        for m in mismatches(engine.compat, other.compat)
    ]


class VllmRouter:
    """One vllm-router's discovery address, fed over a ZMQ DEALER socket (it reconnects by
    itself when the router restarts)."""

    def __init__(self, address: str, context: Any) -> None:
        import zmq

        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 1000)
        self.socket.connect(f"tcp://{address}")

    def announce(self, offered: Sequence[Offered]) -> None:
        import msgpack
        import zmq

        for item in offered:
            try:
                self.socket.send(msgpack.packb(item.message()), zmq.NOBLOCK)
            except zmq.Again:  # router away: its queue is full; it hears the next round
                return

    def close(self) -> None:
        self.socket.close(0)


class Groups:
    """The registry's groups as the watch last said them, shared with the announcing loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engines: dict[str, Any] = {}
        self.synced = threading.Event()
        self.revision = 0

    def apply(self, event: Any) -> None:
        with self.lock:
            self.revision = event.revision
            if event.type == "SYNC":
                self.engines = {e.group_id: e for e in event.groups}
                self.synced.set()
            elif event.type == "DELETED" and event.engine is not None:
                self.engines.pop(event.engine.group_id, None)
            elif event.engine is not None:
                self.engines[event.engine.group_id] = event.engine

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self.engines.values())


def follow(client: Any, groups: Groups, stop: threading.Event, retry_s: float = 2.0) -> None:
    """Keep ``groups`` as the registry says (its own thread); a lost registry is retried."""
    from workers.errors import RegistryUnavailable

    while not stop.is_set():
        try:
            for event in client.watch(idle_timeout_s=20.0, lost_after_s=30.0):
                groups.apply(event)
                if stop.is_set():
                    return
        except RegistryUnavailable as exc:
            log.warning("router-sync: %s; routers keep the last list; retrying", exc)
        except Exception as exc:  # a refusal (token rotated) or a bad answer: said, retried
            log.error("router-sync: the watch failed (%r); routers keep the last list", exc)
        stop.wait(retry_s)


class Announcer:
    """Tells every router the offered instances each round; logs each change of the offer."""

    def __init__(self, routers: Sequence[VllmRouter], model: str | None) -> None:
        self.routers = routers
        self.model = model
        self.offered: dict[tuple[str, str], Offered] = {}
        self.left_out: dict[str, str] = {}

    def round(self, engines: Iterable[Any]) -> list[Offered]:
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
        for router in self.routers:
            router.announce(offered)
        return offered


def run(
    client: Any,
    router_addresses: Sequence[str],
    *,
    model: str | None,
    interval_s: float,
    stop: threading.Event,
    alive_file: Path | None = None,
) -> int:
    """Follow the registry and feed the routers until ``stop``; 0 then. ``alive_file``:
    touched after each round once synced with the registry (an exec probe reads its age)."""
    import zmq

    context = zmq.Context()
    routers = [VllmRouter(address, context) for address in router_addresses]
    groups = Groups()
    watcher = threading.Thread(
        target=follow, args=(client, groups, stop), name="router-sync-watch", daemon=True
    )
    watcher.start()
    announcer = Announcer(routers, model)
    log.warning(
        "router-sync: following %s for %s (every %.1f s)",
        client.url, ", ".join(f"vllm-router {a}" for a in router_addresses), interval_s,
    )  # fmt: skip
    try:
        while not stop.is_set():
            if groups.synced.is_set():
                announcer.round(groups.snapshot())
                if alive_file is not None:
                    alive_file.touch()
            stop.wait(interval_s)
    finally:
        for router in routers:
            router.close()
        context.term()
    return 0


def check_interval(interval_s: float) -> str | None:
    if not 0.05 <= interval_s < ROUTER_EXPIRY_S:
        return (
            f"--interval {interval_s:g} must be from 0.05 to below {ROUTER_EXPIRY_S:g} s "
            "(vllm-router forgets an instance it has not heard of for 5 s)"
        )
    return None


__all__ = ["Announcer", "Groups", "Offered", "VllmRouter", "check_interval", "offer", "run"]
