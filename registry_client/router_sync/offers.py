"""What router-sync offers routers (`offer`): engines that are ready and published where they
serve, of one model; decode instances compatible with the oldest one; prefill instances
compatible with every offered decode (the registry's compat rule, as its handshake applies it).
`Groups`: the groups as the watch last told them."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from registry_client.compat import mismatches

log = logging.getLogger("engine_registry.router_sync")

DECODING = ("decode", "both")


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

    ``engines``: `registry_client.models.Engine` objects (their ``raw`` carries ``serving``);
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
