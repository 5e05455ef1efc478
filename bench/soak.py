"""``python -m bench.soak [--minutes M]``: does the registry keep what it should not?

Ten minutes of churn against one registry process on SQLite (defaults), about 150 requests a
second from 160 group slots at once. Each slot, over and over: opens a new group (TP 2, a
fresh group id each time), registers both ranks with 4 to 64 KiB blobs (rank 0 on a 30 s
lease, rank 1 on a 5 s one), handshakes as a decode rank, renews rank 0 only (rank 1's lease
runs out: lease expiries, later handshakes answered 503 ``not_ready``), handshakes again,
sends a refused handshake (``incompatible``) and a refused heartbeat
(``engine_id_mismatch``, a made-up engine id), relaunches the group one to three times,
then deletes it. Every 5 s the server's RSS, open descriptors and store size (the
SQLite file and its WAL) are sampled.

Verdict (``ok``): after the warm-up (the first half), neither RSS nor the store keeps growing:
the least-squares slope over the last half, projected over that half, stays under 5% of the
value at its start (relative, not a fixed number of MiB); no answer is a 5xx other than the
expected ``503 not_ready``; no request fails at the transport. ``python -m bench.run --only
soak`` runs it with the other questions; run alone, it writes ``bench/results/soak.json`` and
puts its section in ``bench/results/latest.md`` (replacing an earlier soak section only).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import RESULTS, machine, registry_server, say, write_result

SLOTS = 160
RATE = 150.0  # requests a second, all slots together
SAMPLE_S = 5.0
GROWTH = 0.05  # the last half may grow by less than this share of its starting value


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _store_mib(db: Path) -> float:
    files = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    return sum(f.stat().st_size for f in files if f.exists()) / (1024 * 1024)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, value)`` points, per unit of t."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


def verdict(samples: list[dict[str, float]], key: str) -> dict[str, Any]:
    """Growth of ``key`` over the last half, projected by its slope, as a share of its value
    at the start of that half."""
    half = samples[len(samples) // 2 :]
    points = [(s["t"], s[key]) for s in half]
    per_s = slope(points)
    span = points[-1][0] - points[0][0] if len(points) > 1 else 0.0
    start = points[0][1] if points else 0.0
    share = per_s * span / start if start else 0.0
    return {
        "slope_per_min": round(per_s * 60, 4),
        "last_half_growth": round(share, 4),
        "ok": share < GROWTH,
    }


class Churn:
    def __init__(self, url: str, stop_at: float) -> None:
        self.url = url
        self.stop_at = stop_at
        self.statuses: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.requests = 0
        self.pause_s = SLOTS / RATE

    async def call(
        self, http: aiohttp.ClientSession, method: str, path: str, body: Any = None
    ) -> dict[str, Any] | None:
        """The answer's JSON (``status`` added), None when the request failed in transport."""
        await asyncio.sleep(self.pause_s * random.uniform(0.5, 1.5))
        self.requests += 1
        try:
            async with http.request(method, self.url + path, json=body) as r:
                data = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failures[type(exc).__name__] += 1
            return None
        answer: dict[str, Any] = json.loads(data) if data else {}
        code = answer.get("code", "") if status >= 400 else ""
        self.statuses[f"{status} {code}".strip()] += 1
        return answer | {"status": status}

    async def slot(self, http: aiohttp.ClientSession, n: int) -> None:
        while time.monotonic() < self.stop_at:
            gid = f"soak-{n}-{uuid.uuid4().hex[:8]}"
            for _ in range(random.randint(2, 4)):  # the first open, then relaunches
                await self.generation(http, gid)
                if time.monotonic() >= self.stop_at:
                    break
            await self.call(http, "DELETE", f"/tp-groups/{gid}")

    async def generation(self, http: aiohttp.ClientSession, gid: str) -> None:
        body = {
            "launch_id": uuid.uuid4().hex,
            "tp_size": 2,
            "role": "prefill",
            "compat": {"model": "soak", "block_size": 16},
        }
        r = await self.call(http, "PUT", f"/tp-groups/{gid}/engine", body)
        if r is None or r["status"] not in (200, 201):
            return
        eid = r["engine_id"]
        handshake = {"tp_size": 1, "rank": 0}
        for rank, ttl_s in ((0, 30), (1, 5)):
            blob = os.urandom(random.randint(4, 64) * 1024)
            agent = {
                "engine_id": eid,
                "agent_name": f"{gid}-{rank}",
                "host": "127.0.0.1",
                "agent_metadata": base64.b64encode(blob).decode(),
                "kv": {
                    "mem_type": "DRAM",
                    "device_id": 0,
                    "base_addrs": [4096],
                    "num_blocks": 8,
                    "block_len": 4096,
                },
                "ttl_s": ttl_s,
            }
            await self.call(http, "PUT", f"/tp-groups/{gid}/engine/agents/{rank}", agent)
        await self.call(http, "POST", f"/engines/{eid}/handshake", handshake)
        beat = {"engine_id": eid}
        for _ in range(random.randint(2, 7)):  # rank 1 is never renewed: it expires
            await self.call(http, "POST", f"/tp-groups/{gid}/engine/agents/0/heartbeat", beat)
        await self.call(http, "POST", f"/engines/{eid}/handshake", handshake)  # 503 not_ready?
        wrong = {"tp_size": 2, "rank": 1, "compat": {"model": "other-" + uuid.uuid4().hex}}
        await self.call(http, "POST", f"/engines/{eid}/handshake", wrong)
        made_up = {"engine_id": str(uuid.uuid4())}
        await self.call(http, "POST", f"/tp-groups/{gid}/engine/agents/0/heartbeat", made_up)


async def _soak(url: str, pid: int, db: Path, seconds: float) -> dict[str, Any]:
    t0 = time.monotonic()
    churn = Churn(url, t0 + seconds)
    samples: list[dict[str, float]] = []

    async def sample() -> None:
        while time.monotonic() < churn.stop_at + 0.1:
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 1),
                    "rss_mib": round(_rss_mib(pid), 2),
                    "fds": len(os.listdir(f"/proc/{pid}/fd")),
                    "store_mib": round(_store_mib(db), 3),
                    "requests": churn.requests,
                }
            )
            if len(samples) % 12 == 1:
                say(f"soak: {samples[-1]}")
            await asyncio.sleep(SAMPLE_S)

    connector = aiohttp.TCPConnector(limit=64)
    timeout = aiohttp.ClientTimeout(total=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(sample(), *(churn.slot(http, n) for n in range(SLOTS)))
    errors = sum(n for s, n in churn.statuses.items() if s.startswith("5") and "not_ready" not in s)
    verdicts = {
        k: verdict(samples, v)
        for k, v in (("rss", "rss_mib"), ("store", "store_mib"), ("fds", "fds"))
    }
    result: dict[str, Any] = {
        "seconds": seconds,
        "slots": SLOTS,
        "rate_target": RATE,
        "requests": churn.requests,
        "requests_per_s": round(churn.requests / seconds, 1),
        "statuses": dict(sorted(churn.statuses.items())),
        "transport_failures": dict(churn.failures),
        "errors_5xx": errors,
        "samples": samples,
        **verdicts,
    }
    flat = all(v["ok"] for v in verdicts.values())
    result["ok"] = bool(flat and errors == 0 and not churn.failures)
    return result


def run(quick: bool = False, minutes: float | None = None) -> dict[str, Any]:
    seconds = 60.0 * (minutes if minutes is not None else (1.0 if quick else 10.0))
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        db = Path(d) / "registry.db"
        with registry_server(f"sqlite:///{db}", log=Path(d) / "registry.log") as url:
            return asyncio.run(_soak(url, url.pid, db, seconds))


def section(data: dict[str, Any]) -> list[str]:
    """The soak's section of ``latest.md``: the figures and the curve, one row a minute."""
    rss, store, fds = data["rss"], data["store"], data["fds"]
    lines = [
        f"### Soak: {data['seconds'] / 60:g} minutes of churn (`bench/soak.py`, SQLite)",
        "",
        f"{data['requests']:,} requests ({data['requests_per_s']} a second) from {data['slots']} "
        "group slots: opens, relaunches, deletes, 5 s leases left to expire, refused "
        "handshakes and heartbeats, handshakes. "
        f"Verdict: **{'flat' if data['ok'] else 'GROWING or failing'}**. RSS slope over the "
        f"last half {rss['slope_per_min']:+.3f} MiB/min ({rss['last_half_growth']:+.1%} over "
        f"that half); store {store['slope_per_min']:+.4f} MiB/min "
        f"({store['last_half_growth']:+.1%}); descriptors {fds['slope_per_min']:+.3f}/min; "
        f"5xx other than not_ready: {data['errors_5xx']}; transport failures: "
        f"{sum(data['transport_failures'].values())}.",
        "",
        "Answers: " + ", ".join(f"{k}: {v:,}" for k, v in data["statuses"].items()) + ".",
        "",
        "| minute | RSS (MiB) | open fds | store (MiB) | requests so far |",
        "|---:|---:|---:|---:|---:|",
    ]
    shown = -60.0
    for s in data["samples"]:
        if s["t"] - shown >= 60 or s is data["samples"][-1]:
            shown = s["t"]
            lines.append(
                f"| {s['t'] / 60:.1f} | {s['rss_mib']:.1f} | {s['fds']:.0f} | "
                f"{s['store_mib']:.2f} | {s['requests']:,.0f} |"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args(argv)
    data = run(minutes=args.minutes) | {"question": "soak", "machine": machine()}
    write_result("soak", data)
    latest = RESULTS / "latest.md"
    text = latest.read_text() if latest.exists() else ""
    head = text.split("### Soak:", 1)[0].rstrip() + "\n\n"
    latest.write_text(head + "\n".join(section(data)).rstrip() + "\n")
    print("\n".join(section(data)))
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
