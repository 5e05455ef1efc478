"""Helpers of the fault tier: a failover HTTP client, replica sets, recovery-time records.

Everything here talks to real processes on 127.0.0.1 only, and every loop is bounded in
count and in time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.server import RegistryProcess

OUTPUT_DIR = Path(__file__).resolve().parents[1] / "output"  # tests/output (git-ignored)
RECOVERY: dict[str, dict[str, Any]] = {}


async def while_stopped(pid: int, calls: Sequence[Awaitable[Any]]) -> tuple[list[Any], float]:
    """``calls`` run to their ends (answer or exception) while process ``pid`` (an etcd
    member) is stopped (SIGSTOP; SIGCONT on the way out, whatever happens): their outcomes and
    the seconds they took together."""
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return list(outcomes), time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)


def record(name: str, **facts: Any) -> None:
    """Keep one fault's measured times (seconds); the session writes them out as JSON."""
    RECOVERY[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in facts.items()}
    print(f"[recovery] {name}: {json.dumps(RECOVERY[name])}")


def write_recovery() -> Path | None:
    if not RECOVERY:
        return None
    OUTPUT_DIR.mkdir(exist_ok=True)
    path = OUTPUT_DIR / "recovery.json"
    path.write_text(json.dumps(RECOVERY, indent=2, sort_keys=True) + "\n")
    return path


def open_body(
    launch_id: str | None = None, tp_size: int = 1, role: str = "prefill"
) -> dict[str, Any]:
    return {"launch_id": launch_id or uuid.uuid4().hex, "tp_size": tp_size, "role": role}


def agent_body(engine_id: str, rank: int, ttl_s: int = 30) -> dict[str, Any]:
    return {
        "engine_id": engine_id,
        "agent_name": f"{engine_id}-rank{rank}",
        "agent_metadata": base64.b64encode(f"nixl-md-{rank}".encode()).decode(),
        "host": "127.0.0.1",
        "kv": {
            "mem_type": "DRAM",
            "device_id": 0,
            "base_addrs": [4096],
            "num_blocks": 8,
            "block_len": 4096,
        },
        "ttl_s": ttl_s,
    }


def node(http: httpx.Client, gid: str, ranks: Sequence[int], tp_size: int = 8) -> str:
    """Open ``gid`` (TP ``tp_size``) and register ``ranks`` in one batch, one lease, as a
    node does; its engine_id."""
    opened = http.put(f"/tp-groups/{gid}/engine", json=open_body(tp_size=tp_size))
    assert opened.status_code in (200, 201), opened.text
    eid = str(opened.json()["engine_id"])
    batch = {"agents": [{**agent_body(eid, r), "rank": r} for r in ranks]}
    assert http.put(f"/tp-groups/{gid}/engine/agents", json=batch).status_code == 200
    return eid


def node_beat(http: httpx.Client, gid: str, eid: str, ranks: list[int]) -> httpx.Response:
    """A node's heartbeat for ``ranks``."""
    body = {"engine_id": eid, "ranks": ranks}
    return http.post(f"/tp-groups/{gid}/engine/agents/heartbeat", json=body)


def refused_after_deregistration(http: httpx.Client, gid: str, tag: object = None) -> None:
    """A node of ranks 0 and 1 on one lease; rank 0 deregistered. A heartbeat naming rank 0 is
    404 naming it (the lease lives on through rank 1), one for rank 1 alone is 200."""
    eid = node(http, gid, range(2))
    gone = http.delete(f"/tp-groups/{gid}/engine/agents/0", params={"engine_id": eid})
    assert gone.status_code == 204, gone.text
    answer = node_beat(http, gid, eid, [0, 1])
    assert answer.status_code == 404, (tag, answer.text)
    assert "rank 0" in answer.json()["detail"], answer.text
    assert node_beat(http, gid, eid, [1]).status_code == 200


@dataclass
class Answer:
    response: httpx.Response
    retries: int
    started: float
    finished: float
    failures: list[str] = field(default_factory=list)


# Transport errors after which the same request goes to the next replica.
_FAILOVER = (httpx.TransportError,)


class FailoverClient:
    """Sends each request to one replica, and on a transport error or a 503
    ``store_unavailable`` to the next, until ``deadline_s`` passes (retry-safe by the
    contract: the same launch_id or agent body)."""

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 15.0) -> None:
        self.urls = list(urls)
        self.http = httpx.AsyncClient(
            timeout=request_timeout_s, limits=httpx.Limits(max_connections=200)
        )

    async def __aenter__(self) -> FailoverClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        start: int = 0,
        deadline_s: float = 30.0,
        retry_503: bool = True,
        **kwargs: Any,
    ) -> Answer:
        t0 = time.monotonic()
        failures: list[str] = []
        for attempt in range(1000):
            url = self.urls[(start + attempt) % len(self.urls)]
            try:
                response = await self.http.request(method, url + path, **kwargs)
            except _FAILOVER as exc:
                failures.append(f"{url}: {type(exc).__name__}")
            else:
                retryable = response.status_code == 503 and (
                    response.json().get("code") == "store_unavailable"
                )
                if not (retry_503 and retryable):
                    return Answer(response, attempt, t0, time.monotonic(), failures)
                failures.append(f"{url}: 503 {response.json().get('detail')}")
            if time.monotonic() - t0 > deadline_s:
                break
            await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
        raise AssertionError(
            f"{method} {path} got no answer within {deadline_s} s: {failures[-5:]}"
        )


@contextmanager
def replicas(
    store: str, count: int, tmp_path: Path, *, store_timeout_s: float = 5.0
) -> Iterator[list[RegistryProcess]]:
    """``count`` ``engine-registry serve`` processes on one store, started in parallel."""
    procs = [
        RegistryProcess(
            store,
            args=["--store-timeout", str(store_timeout_s), "--log-level", "warning"],
            log_path=tmp_path / f"replica{i}.log",
        )
        for i in range(count)
    ]
    try:
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda p: p.start(timeout_s=60.0), procs))
        yield procs
    finally:
        for p in procs:
            p.kill()


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> float:
    """Poll ``predicate`` until it is true; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


@dataclass
class Storm:
    """Launch storms: each group's rank 0 relaunches ``launches`` times, one after another,
    over a failover client; every answer is kept to check that none is lost."""

    client: FailoverClient
    groups: list[str]
    launches: int
    answered: list[tuple[str, str, str, int]] = field(default_factory=list)
    failed_over: list[Answer] = field(default_factory=list)
    timings: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def _group(self, index: int, gid: str) -> None:
        for _ in range(self.launches):
            launch_id = uuid.uuid4().hex
            answer = await self.client.request(
                "PUT", f"/tp-groups/{gid}/engine", start=index, json=open_body(launch_id)
            )
            body = answer.response.json()
            if answer.response.status_code not in (200, 201) or body["launch_id"] != launch_id:
                self.errors.append(f"{gid}: {answer.response.status_code} {body}")
                return
            self.answered.append((gid, launch_id, body["engine_id"], body["generation"]))
            self.timings.append(answer)
            if answer.failures:
                self.failed_over.append(answer)

    async def run(self) -> None:
        await asyncio.gather(*(self._group(i, g) for i, g in enumerate(self.groups)))

    async def wait_answered(self, count: int, timeout_s: float = 30.0) -> None:
        t0 = time.monotonic()
        while len(self.answered) < count:
            assert time.monotonic() - t0 < timeout_s, f"only {len(self.answered)} answered"
            await asyncio.sleep(0.01)


def verify_nothing_lost(url: str, storm: Storm) -> None:
    """Every answered engine is still known: the last of each group is current (200), each
    earlier one answers 410 naming it; generations ran 1, 2, … with no gap."""
    assert not storm.errors, storm.errors[:5]
    with httpx.Client(base_url=url, timeout=15) as http:
        for gid in storm.groups:
            mine = [a for a in storm.answered if a[0] == gid]
            assert [a[3] for a in mine] == list(range(1, storm.launches + 1)), mine
            current = http.get(f"/tp-groups/{gid}/engine")
            assert current.status_code == 200, current.text
            assert current.json()["engine_id"] == mine[-1][2]
            for _, _, engine_id, _ in mine[:-1]:
                old = http.get(f"/engines/{engine_id}")
                assert old.status_code == 410, old.text
                assert old.json()["current_engine_id"] == mine[-1][2]
            assert http.get(f"/engines/{mine[-1][2]}").status_code == 200
