"""router-sync's smg feed: SGLang's model gateway (PyPI ``smg``, 1.13.0) kept in step with the
registry through its worker API.

smg learns workers from ``POST /workers`` (a `WorkerSpec`: ``url``, ``worker_type`` prefill |
decode, ``connection_mode`` grpc | http, ``runtime_type`` vllm, ``kv_connector``,
``kv_engine_id``, ``labels``, ``health``), lists them at ``GET /workers`` (each with its ``id``)
and forgets one at ``DELETE /workers/{id}`` (202; it is marked draining at once, so no new
request goes to it, and leaves the list after its ``health.drain_settle_secs``). Unlike
vllm-router's discovery, removal is a message: router-sync withdraws an instance the round
after the registry's word, not after an expiry.

Each round (`SmgFeeds.round`): the instances to register are
`registry_client.router_sync.offers.offer`'s (the
same model and compat rule as for vllm-router; gRPC URLs allowed, as smg's vLLM PD mode uses
vLLM's gRPC entrypoint), and every smg's own list is read (``GET /workers``, one request a
round) and compared with them: a worker router-sync registered (its labels say so) that is
no longer offered, or carries another engine id than the registry's current one, is deleted;
an offered instance smg does not list is registered. So a start, a lost watch, a restarted
smg or a restarted router-sync are reconciled within one round, and a worker someone else
added is never touched unless ``own`` (``--smg-own``) says router-sync owns smg's list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from registry_client.router_sync.offers import offer

log = logging.getLogger("engine_registry.router_sync")

OWNER = "engine_registry.router_sync"  # label on every worker router-sync registered
GROUP, ENGINE, GENERATION = (
    "engine_registry.group",
    "engine_registry.engine_id",
    "engine_registry.generation",
)
PENDING_S = 120.0  # a registration smg has not listed after this long is sent again
KINDS = {"P": "prefill", "D": "decode"}


@dataclass(frozen=True)
class Wanted:
    """One instance as smg is told it."""

    group_id: str
    engine_id: str
    generation: int
    role: str  # prefill | decode
    url: str  # grpc://host:port (vLLM's gRPC entrypoint) or http://host:port
    model: str
    kv_connector: str = "NixlConnector"

    def spec(self, drain_s: int) -> dict[str, Any]:
        labels = {OWNER: "1", GROUP: self.group_id, ENGINE: self.engine_id}
        labels[GENERATION] = str(self.generation)
        grpc = self.url.startswith("grpc://")
        spec: dict[str, Any] = {
            "url": self.url,
            "worker_type": self.role,
            "connection_mode": "grpc" if grpc else "http",
            "runtime_type": "vllm",
            "kv_connector": self.kv_connector,
            "kv_engine_id": self.engine_id,
            "labels": labels,
            "health": {"drain_settle_secs": drain_s},
        }
        if not grpc:  # over gRPC smg reads the model's whole card (tokenizer, capabilities)
            spec["models"] = [{"id": self.model}]
        return spec

    def describe(self) -> str:
        return (
            f"{self.role} {self.group_id} (generation {self.generation}, engine "
            f"{self.engine_id[:8]}) at {self.url}"
        )


def connector_of(engine: Any) -> str:
    """The engine's KV connector as smg names it: MooncakeConnector when its compat says so
    (smg then gives decode ``remote_engine_id``, this generation's ``kv_engine_id``, and a
    ``remote_bootstrap_addr`` built from the prefill's host, which the vLLM plugin's decode
    replaces with the registry's), else NixlConnector."""
    named = str((engine.compat or {}).get("kv_connector", ""))
    return named if named == "MooncakeConnector" else "NixlConnector"


def wanted(engines: Iterable[Any], model: str | None) -> tuple[list[Wanted], dict[str, str]]:
    """(what smg is told, why each other published group is not: group -> cause)."""
    engines = list(engines)
    by_group = {e.group_id: e for e in engines}
    offered, left_out = offer(engines, model, schemes=("grpc", "http"))
    found: dict[str, Wanted] = {}
    for item in offered:
        engine = by_group[item.group_id]
        published = engine.raw["serving"]
        if engine.role == "both":
            left_out[item.group_id] = "role both: smg's PD mode takes one role per URL"
        elif published.get("dp_rank") is not None:
            left_out[item.group_id] = (
                f"data-parallel rank {published['dp_rank']}: smg registers one worker per URL "
                "and assigns ranks itself (--dp-aware); not fed"
            )
        else:
            found[item.group_id] = Wanted(
                item.group_id,
                item.engine_id,
                item.generation,
                KINDS[item.kind],
                str(published["url"]).rstrip("/"),
                str(published["model"]),
                connector_of(engine),
            )
    return [w for g, w in found.items() if g not in left_out], left_out


def _described(worker: dict[str, Any]) -> str:
    labels = worker.get("labels") or {}
    if GROUP not in labels:
        return f"{worker.get('worker_type', 'worker')} {worker.get('id')} at {worker.get('url')}"
    return (
        f"{worker.get('worker_type')} {labels[GROUP]} (generation {labels.get(GENERATION)}, "
        f"engine {str(labels.get(ENGINE))[:8]}) at {worker.get('url')}"
    )


class Smg:
    """One smg's worker API: its list read each round, registrations and withdrawals sent."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        verify: Any = True,
        own: bool = False,
        drain_s: int = 0,
        timeout_s: float = 2.0,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=self.url, headers=headers, verify=verify, timeout=timeout_s
        )
        self.own = own
        self.drain_s = drain_s
        self.pending: dict[str, float] = {}  # url -> when its POST was accepted
        self.failing = ""  # the cause smg's API last failed with ("" while it answers)
        self.foreign: set[str] = set()  # URLs held by workers router-sync did not add (said once)

    def close(self) -> None:
        self.http.close()

    def _failed(self, what: str, exc: Exception | httpx.Response) -> None:
        if isinstance(exc, httpx.Response):
            cause = f"{exc.status_code} {exc.text[:200]}"
            if exc.status_code in (401, 403):
                cause += (
                    "; pass --smg-api-key (SMG_API_KEY): an admin key of smg's "
                    "--control-plane-api-keys, or its --api-key"
                )
        else:
            cause = repr(exc)
        if cause != self.failing:
            log.error(
                "router-sync: smg %s: %s failed (%s); retrying each round", self.url, what, cause
            )
        self.failing = cause

    def listed(self) -> list[dict[str, Any]] | None:
        try:
            answer = self.http.get("/workers")
        except httpx.HTTPError as exc:
            self._failed("GET /workers", exc)
            return None
        if answer.status_code != 200:
            self._failed("GET /workers", answer)
            return None
        if self.failing:
            log.warning("router-sync: smg %s answers again", self.url)
            self.failing = ""
        return list(answer.json().get("workers") or [])

    def sync(
        self,
        want: Sequence[Wanted],
        left_out: dict[str, str],
        blind: str = "",
        current: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        """Make smg's list what ``want`` says; each change one line with its cause."""
        workers = self.listed()
        if workers is None:
            return
        desired = {w.url: w for w in want}
        by_group = {w.group_id: w for w in want}
        kept: set[str] = set()
        busy: set[str] = set()  # URLs whose worker is being removed (a POST would be 409)
        for worker in workers:
            url, labels = str(worker.get("url", "")).rstrip("/"), worker.get("labels") or {}
            self.pending.pop(url, None)
            w = desired.get(url)
            if (
                w is not None
                and labels.get(ENGINE) == w.engine_id
                and worker.get("worker_type") == w.role
            ):
                kept.add(url)
                continue
            if labels.get(OWNER) != "1" and not self.own:
                if w is not None and url not in self.foreign:
                    log.warning(
                        "router-sync: smg %s: not registering %s: smg already has a "
                        "worker at that URL that router-sync did not add (--smg-own "
                        "lets it replace it)",
                        self.url,
                        w.describe(),
                    )
                self.foreign.add(url)
                kept.add(url)
                continue
            busy.add(url)
            if str(worker.get("status", "")).lower() == "draining":
                continue  # withdrawn already, leaving after its drain
            cause = blind or self._cause(labels, w, by_group, left_out, current or {})
            if self._delete(worker):
                log.warning(
                    "router-sync: smg %s: withdraw %s: %s", self.url, _described(worker), cause
                )
        self.foreign &= {str(x.get("url", "")).rstrip("/") for x in workers}
        now = time.monotonic()
        for url, w in desired.items():
            if url in kept or url in busy or now - self.pending.get(url, -PENDING_S) < PENDING_S:
                continue
            self._register(w, now)

    def _cause(
        self,
        labels: dict[str, str],
        w: Wanted | None,
        by_group: dict[str, Wanted],
        left_out: dict[str, str],
        current: dict[str, tuple[str, int]],
    ) -> str:
        group = labels.get(GROUP, "")
        successor = w if w is not None and w.group_id == group else by_group.get(group)
        if successor is not None and successor.engine_id != labels.get(ENGINE):
            return f"superseded by generation {successor.generation}"
        if successor is not None:
            return f"it now serves at {successor.url} as {successor.role}"
        if w is not None:
            return f"its URL now serves {w.describe()}"
        engine_id, generation = current.get(group, ("", 0))
        if engine_id and engine_id != labels.get(ENGINE):
            return f"superseded by generation {generation}"
        if not engine_id and current:
            return "its group is no longer in the registry"
        return left_out.get(group, "no longer in the registry as serving")

    def _delete(self, worker: dict[str, Any]) -> bool:
        try:
            answer = self.http.delete(f"/workers/{worker['id']}")
        except httpx.HTTPError as exc:
            self._failed(f"DELETE /workers/{worker['id']}", exc)
            return False
        if answer.status_code in (200, 202, 204, 404):
            return answer.status_code != 404
        self._failed(f"DELETE /workers/{worker['id']}", answer)
        return False

    def _register(self, w: Wanted, now: float) -> None:
        try:
            answer = self.http.post("/workers", json=w.spec(self.drain_s))
        except httpx.HTTPError as exc:
            self._failed("POST /workers", exc)
            return
        if answer.status_code in (200, 201, 202, 409):  # 409: a registration is under way
            self.pending[w.url] = now
            if answer.status_code != 409:
                log.warning("router-sync: smg %s: register %s", self.url, w.describe())
        else:
            self._failed(f"POST /workers ({w.describe()})", answer)


class SmgFeeds:
    """Every smg, fed the same instances each round; each instance left out said once."""

    def __init__(self, smgs: Sequence[Smg], model: str | None) -> None:
        self.smgs = smgs
        self.model = model
        self.left_out: dict[str, str] = {}

    def round(self, engines: Iterable[Any] | None, blind: str = "") -> list[Wanted]:
        """``engines`` None: router-sync no longer vouches for anything (blind past its
        grace, ``blind`` says why): every worker it registered is withdrawn."""
        current: dict[str, tuple[str, int]] = {}
        if engines is None:
            want: list[Wanted] = []
            left_out: dict[str, str] = {}
        else:
            engines = list(engines)
            current = {e.group_id: (e.engine_id, e.generation) for e in engines}
            want, left_out = wanted(engines, self.model)
            for gid, cause in left_out.items():
                if self.left_out.get(gid) != cause:
                    log.warning("router-sync: smg: not registering %s: %s", gid, cause)
            self.left_out = left_out
        for smg in self.smgs:
            smg.sync(want, left_out, blind, current)
        return want

    def close(self) -> None:
        for smg in self.smgs:
            smg.close()


__all__ = ["OWNER", "Smg", "SmgFeeds", "Wanted", "wanted"]
