"""The fleet's load, as the worker library makes it (``bench/fleet.py`` runs it).

One client process (``bench/raw_client.py``: aiohttp could not keep this pace) plays every
node's leader (``workers.publication.BatchPublication``:
a TP 8 group on one node, so one leader, one lease and one heartbeat stream per group):

- **launch**: each group opens its engine (``PUT /tp-groups/{g}/engine``) and registers its
  eight ranks in one request (``PUT …/engine/agents``, one shared lease of ``TTL_S``), 64
  groups in flight; the fleet is ready when the last group's registration is answered;
- **heartbeats**: from its registration on, each group renews its lease every ``TTL_S / 3``
  seconds (the library's default pace) with ``POST …/agents/heartbeat``, at a phase of its
  own, until the run ends (through the registry's restart too, as workers would);
- **steady state**: once the fleet is ready, after ``warmup_s``, a window of ``window_s``
  in which decode leaders also plan against random prefill engines
  (``POST /engines/{id}/handshake``, the leader's plan for all eight prefill ranks) at
  ``handshakes_per_s``; then ``after_window`` (the reads, the restart) runs in a thread while
  the heartbeats go on.

**Replicas** (``url`` a list, ``bench/replica_kill.py``): a pool of connections a replica, as a
load balancer would spread the nodes: the n-th pair of groups (a prefill and a decode node)
lists the replicas from the ``n % len(urls)``-th on and talks to its first. A node moves as
``registry_client``'s transport does (``Route``): on a refused or broken connection (or a
503/429) it tries its next replica at once, pauses by the one back-off policy
(``registry_client.backoff``, the transport's defaults: full jitter from [0, 0.1 s] doubling to
[0, 2 s]) only after every replica failed, gives up at the heartbeat's interval, and keeps the
replica that answered last. Every heartbeat try is logged in ``Run.tries``. With one URL
nothing of this runs: a refused heartbeat is answered 0 and the next beat is on schedule.

Latencies are from the client's send to its answer, so they include the client's own
scheduling delay: ``lag`` (how late each heartbeat was sent against its schedule) is reported
beside them, and ``bench/fleet.py`` runs the same pace against a server that does no work.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import summary_ms
from bench.fleet_stream import NodeStream
from bench.raw_client import RawPool
from bench.storm_core import COMPAT
from registry_client.backoff import Backoff
from workers.keepalive import stream_url

TP = 8
TTL_S = 30  # the library's default lease
HEARTBEAT_S = TTL_S / 3  # LeaseKeeper's default fraction
IN_FLIGHT = 64
# The client's connections at most (more requests wait for one): below the registry's default
# max_connections (8,192), past which it closes the idlest connection.
CONNECTIONS = 1024
PLANNERS = 4
# registry_client.transport's defaults: the pause after every replica refused a call.
CALL_BACKOFF_BASE_S = 0.1
CALL_BACKOFF_CAP_S = 2.0


@dataclass
class Fleet:
    """The groups of a fleet of ``ranks`` (TP 8: half prefill, half decode)."""

    ranks: int
    blob_bytes: int
    regions: int
    engines: dict[str, str] = field(default_factory=dict)  # group id -> engine id
    # real NIXL metadata (bench.blob_size.samples), one a node in turn; none: random bytes of
    # ``blob_bytes`` a node, which no codec shrinks
    blobs: list[bytes] = field(default_factory=list)

    @property
    def groups(self) -> list[str]:
        n = self.ranks // TP
        return [f"{'prefill' if i % 2 == 0 else 'decode'}-{i:06d}" for i in range(n)]

    def agents(self, index: int, eid: str) -> list[dict[str, Any]]:
        raw = self.blobs[index % len(self.blobs)] if self.blobs else os.urandom(self.blob_bytes)
        blob = base64.b64encode(raw).decode()
        base = 0x7F0000000000 + (index << 32)
        return [
            {
                "rank": rank,
                "engine_id": eid,
                "agent_name": f"{eid}-rank{rank}",
                "agent_metadata": blob,
                "host": f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}",
                "kv": {
                    "mem_type": "VRAM",
                    "device_id": rank,
                    # one region per layer, as vLLM registers a 70B model's KV cache
                    "base_addrs": [base + (rank << 28) + (r << 20) for r in range(self.regions)],
                    "num_blocks": 86_000,
                    "block_len": 65_536,
                },
                "ttl_s": TTL_S,
            }
            for rank in range(TP)
        ]


@dataclass
class Run:
    """What a run saw: latencies by phase, answers by status."""

    opens: list[float] = field(default_factory=list)
    registers: list[float] = field(default_factory=list)
    registered_at: list[float] = field(default_factory=list)  # each group's, perf_counter
    beats: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    plans: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)  # answers after the window
    window: tuple[float, float] = (float("inf"), float("inf"))
    # with several replicas, every heartbeat try: (sent, answered, group index, replica
    # index in ``urls``, status; 0 for a refused or broken connection)
    tries: list[tuple[float, float, int, int, int]] = field(default_factory=list)

    def count(self, kind: str, status: int, sent: float) -> None:
        into = self.after if sent >= self.window[1] else self.statuses
        key = f"{kind} {status}"
        into[key] = into.get(key, 0) + 1


def first_replica(index: int, replicas: int) -> int:
    """The replica the ``index``-th group talks to first: pairs (a prefill and a decode node)
    alternate."""
    return (index // 2) % replicas


class Route:
    """A node's way to the registry: its replicas in its own order, the one that answered last
    first (``registry_client.transport``'s rule); one replica: its pool, nothing more."""

    def __init__(self, pools: Sequence[RawPool], run: Run, index: int) -> None:
        first = first_replica(index, len(pools))
        self.order = [(first + k) % len(pools) for k in range(len(pools))]
        self.pools, self.run, self.index = pools, run, index
        self.at = 0  # into ``order``

    @property
    def pool(self) -> RawPool:
        return self.pools[self.order[self.at]]

    async def send(self, request: bytes, budget_s: float) -> tuple[int, bytes]:
        """The answer of the first replica that answers within ``budget_s``; OSError if none
        did (a refused connection is tried on the next replica at once, the back-off after
        every replica refused)."""
        if len(self.pools) == 1:
            return await self.pools[0].send(request)
        n, attempt = len(self.order), 0
        backoff = Backoff(base_s=CALL_BACKOFF_BASE_S, cap_s=CALL_BACKOFF_CAP_S)
        deadline = time.perf_counter() + budget_s
        while True:
            k = (self.at + attempt) % n
            replica, sent = self.order[k], time.perf_counter()
            try:
                status, body = await self.pools[replica].send(request)
            except OSError:
                status, body = 0, b""
            self.run.tries.append((sent, time.perf_counter(), self.index, replica, status))
            if status not in (0, 429, 503):
                self.at = k
                return status, body
            attempt += 1
            if attempt % n == 0:
                pause = min(backoff.next(), deadline - time.perf_counter())
                if pause <= 0:
                    raise ConnectionError(f"no replica answered within {budget_s:.1f} s")
                await asyncio.sleep(pause)


async def _beat(
    route: Route,
    gid: str,
    eid: str,
    phase: float,
    stop: asyncio.Event,
    again: Callable[[], dict[str, Any]] | None = None,
    streams: list[NodeStream] | None = None,
) -> None:
    """Renew every ``HEARTBEAT_S``; after a 404 (the lease lapsed) register again with
    ``again()``'s body, as ``BatchPublication`` does. ``streams`` (``renew="stream"``): over
    the node's keep-alive stream, appended there (REST where it has none: ``NodeStream``)."""
    run = route.run
    stream = None
    if streams is not None:
        where = f"http://{route.pool.host}:{route.pool.port}"
        stream = NodeStream(stream_url(where), gid, eid, list(range(TP)))
        streams.append(stream)
    beat = RawPool.prepare(
        "POST",
        f"/tp-groups/{gid}/engine/agents/heartbeat",
        {"engine_id": eid, "ranks": list(range(TP))},
    )
    due = time.perf_counter() + phase
    while not stop.is_set():
        # A plain sleep (the run cancels the task at its end): a wait_for on the stop event
        # made a task and a timer a beat, the client's largest cost at 12,500 groups.
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        sent = time.perf_counter()
        status = await stream.renew(HEARTBEAT_S) if stream is not None else None
        kind = "keep-alive" if status is not None else "heartbeat"
        if status is None:
            try:
                status, _ = await route.send(beat, HEARTBEAT_S)
            except OSError:
                status = 0  # the registry unreachable (its restart): the next beat tries again
        done = time.perf_counter()
        if run.window[0] <= sent < run.window[1]:
            run.beats.append(done - sent)
            run.lags.append(sent - due)
        run.count(kind, status, sent)
        if status == 404 and again is not None:
            path = f"/tp-groups/{gid}/engine/agents"
            status, _ = await _put(route.pool, path, again(), run)
            run.count("re-register", status, sent)
        due += HEARTBEAT_S


async def _put(pool: RawPool, path: str, body: dict[str, Any], run: Run) -> tuple[int, Any]:
    """A PUT (idempotent) sent again after the registry was unreachable, as the worker
    library's client retries transport errors (bounded); the retries are counted."""
    for attempt in range(5):
        try:
            return await pool.request("PUT", path, body)
        except OSError:
            key = "PUT retried after a dropped connection"
            run.statuses[key] = run.statuses.get(key, 0) + 1
            await asyncio.sleep(0.05 * 2**attempt)
    return 0, None


async def _group(
    route: Route,
    fleet: Fleet,
    index: int,
    gid: str,
    gate: asyncio.Semaphore,
    stop: asyncio.Event,
    beats: list[asyncio.Task[None]],
    streams: list[NodeStream] | None,
) -> None:
    role = "prefill" if gid.startswith("prefill") else "decode"
    pool, run = route.pool, route.run
    body = {"launch_id": uuid.uuid4().hex, "tp_size": TP, "role": role, "compat": COMPAT}
    async with gate:
        t = time.perf_counter()
        status, answer = await _put(pool, f"/tp-groups/{gid}/engine", body, run)
        run.opens.append(time.perf_counter() - t)
        if status not in (200, 201):
            run.errors.append(f"open {gid}: {status}")
            return
        eid = answer["engine_id"]
        agents = {"agents": fleet.agents(index, eid)}
        t = time.perf_counter()
        status, _ = await _put(pool, f"/tp-groups/{gid}/engine/agents", agents, run)
        run.registers.append(time.perf_counter() - t)
        run.registered_at.append(time.perf_counter())
        if status != 200:
            run.errors.append(f"register {gid}: {status}")
            return
        fleet.engines[gid] = eid
    phase = random.Random(index).uniform(0, HEARTBEAT_S)
    again = lambda: {"agents": fleet.agents(index, eid)}  # noqa: E731
    beats.append(asyncio.create_task(_beat(route, gid, eid, phase, stop, again, streams)))


def _pool(url: str) -> RawPool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return RawPool(host, int(port), CONNECTIONS)


async def _planner(pool: RawPool, run: Run, prefill: list[str], rate: float, seed: int) -> None:
    rng = random.Random(seed)
    body = {"tp_size": 1, "rank": 0, "compat": COMPAT}
    due = run.window[0]
    while due < run.window[1]:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        sent = time.perf_counter()
        status, _ = await pool.send(
            RawPool.prepare("POST", f"/engines/{rng.choice(prefill)}/handshake", body)
        )
        run.plans.append(time.perf_counter() - sent)
        run.count("handshake", status, sent)
        due += PLANNERS / rate


def quarters(done: list[float], t0: float) -> dict[str, Any]:
    """Groups registered a second in each quarter of the launch's groups (by their order of
    completion), and the last quarter's rate over the first's (issue 51: ≥ 0.7, a launch whose
    cost per group does not grow with the fleet)."""
    done = sorted(done)
    n = len(done) // 4
    if n == 0:
        return {}
    edges = [t0, done[n - 1], done[2 * n - 1], done[3 * n - 1], done[-1]]
    counts = [n, n, n, len(done) - 3 * n]
    rates = [c / max(1e-9, b - a) for c, a, b in zip(counts, edges[:-1], edges[1:], strict=True)]
    return {
        "groups_per_s_by_quarter": [round(r) for r in rates],
        "last_quarter_over_first": round(rates[3] / rates[0], 2),
    }


async def fleet_run(
    url: str | Sequence[str],
    fleet: Fleet,
    *,
    warmup_s: float,
    window_s: float,
    handshakes_per_s: float,
    on_window: Callable[[bool], None] | None = None,
    after_window: Callable[[], dict[str, Any]] | None = None,
    on_ready: Callable[[], dict[str, Any]] | None = None,
    launch: bool = True,
    run: Run | None = None,
    renew: str = "rest",
) -> dict[str, Any]:
    """Launch (unless ``launch`` is False: ``fleet.engines`` is given), heartbeats, the
    window, ``after_window`` in a thread; ``on_window(start)`` marks the window's ends,
    ``on_ready()`` the launch's (what it returns joins the launch's figures).
    ``url``: one registry, or its replicas (the module's doc); ``run``: what is seen goes
    there (``after_window`` may read it). ``renew``: ``rest`` (``POST …/heartbeat``) or
    ``stream`` (one keep-alive stream a node, ``bench/fleet_stream.py``; one registry)."""
    if renew not in ("rest", "stream"):
        raise ValueError(f"renew={renew!r}: 'rest' or 'stream'")
    if renew == "stream" and not isinstance(url, str):
        raise ValueError("renew='stream' takes one registry url (a node's stream has no Route)")
    streams: list[NodeStream] | None = [] if renew == "stream" else None
    run, stop = run or Run(), asyncio.Event()
    gate = asyncio.Semaphore(IN_FLIGHT)
    beats: list[asyncio.Task[None]] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    pools = [_pool(u) for u in ([url] if isinstance(url, str) else url)]
    try:
        if launch:
            await asyncio.gather(
                *(
                    _group(Route(pools, run, i), fleet, i, g, gate, stop, beats, streams)
                    for i, g in enumerate(fleet.groups)
                )
            )
            ready = time.perf_counter() - t0
            out["launch"] = {
                "ready_s": round(ready, 2),
                "ranks_per_s": round(fleet.ranks / ready),
                "open": summary_ms(run.opens),
                "register": summary_ms(run.registers),
                **quarters(run.registered_at, t0),
                "errors": len(run.errors),
                "first_errors": run.errors[:5],
                "client_cpu_s": round(time.process_time() - cpu0, 2),
                **(on_ready() if on_ready else {}),
            }
        else:
            rng = random.Random(3)
            beats += [
                asyncio.create_task(
                    _beat(
                        Route(pools, run, i), g, e, rng.uniform(0, HEARTBEAT_S), stop, None, streams
                    )
                )
                for i, (g, e) in enumerate(fleet.engines.items())
            ]
        # The client's heap (every node's connection, stream and task) frozen out of the
        # collector, as the registry's is (app/core/gcfreeze.py): its full collections
        # stalled this loop, delaying the answers in flight (client lag, docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        start = time.perf_counter() + warmup_s
        run.window = (start, start + window_s)
        prefill = [eid for gid, eid in fleet.engines.items() if gid.startswith("prefill")]
        await asyncio.sleep(warmup_s)
        if on_window:
            on_window(True)
        cpu1 = time.process_time()
        if prefill and handshakes_per_s > 0:
            await asyncio.gather(
                *(
                    _planner(pools[k % len(pools)], run, prefill, handshakes_per_s, k)
                    for k in range(PLANNERS)
                )
            )
        await asyncio.sleep(max(0.0, run.window[1] - time.perf_counter()))
        if on_window:
            on_window(False)
        client = time.process_time() - cpu1
        if after_window:
            out["after_window"] = await asyncio.to_thread(after_window)
        stop.set()
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
    finally:
        for pool in pools:
            pool.close()
        if streams:
            await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
    out["steady"] = {
        "window_s": window_s,
        "heartbeat": summary_ms(run.beats),
        "heartbeats_per_s": round(len(run.beats) / window_s, 1),
        "client_lag": summary_ms(run.lags),
        "handshake": summary_ms(run.plans),
        "handshakes_per_s": round(len(run.plans) / window_s, 1),
        "statuses": run.statuses,
        "client_cpu_share": round(client / window_s, 3),
    }
    out["after_window_statuses"] = run.after
    if streams is not None:
        refused: dict[str, int] = {}
        for s in streams:
            if s.refused is not None:
                refused[str(s.refused)] = refused.get(str(s.refused), 0) + 1
        out["streams"] = {
            "nodes": len(streams),
            "opened": sum(s.opened for s in streams),
            "refused_now": refused,
        }
    return out
