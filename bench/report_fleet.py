"""The fleet question's table and targets (``bench/fleet.py``) for ``bench/results/latest.md``."""

from __future__ import annotations

from typing import Any

READY_S = 10.0  # SQLite, 100,000 ranks
CORE_SHARE = 0.15  # per-node heartbeats at the default pace
HEARTBEAT_P99_MS = 20.0
PAGE_MS = 100.0  # a page of 500 groups
STATUS_KIB = 1000.0  # a status page
RESTART_S = 5.0
GOAL_RANKS = 100_000


def _ok(row: dict[str, Any]) -> bool:
    return bool(row) and "failed" not in row


def targets(f: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    out: list[tuple[str, str, str, bool | None]] = []
    # The goals are the issue's, at 100,000 ranks: a smaller run judges none of them.
    rows = [r for r in f.get("rows", {}).get("sqlite", []) if _ok(r) and r["ranks"] >= GOAL_RANKS]
    if not rows:
        return out
    top = max(rows, key=lambda r: r["ranks"])
    n = f"{top['ranks']:,} ranks, SQLite"
    ready, share = top["launch"]["ready_s"], top["steady"]["server_core_share"]
    p99 = top["steady"]["heartbeat"]["p99_ms"]
    page = max(top["reads"]["page_500_ms"])
    status = top["reads"]["status_kib"]
    restart = top["restart"]["serving_s"]
    out += [
        (f"fleet ready ({n})", f"{ready} s", f"bound {READY_S:g} s", ready <= READY_S),
        (
            f"per-node heartbeats: server CPU ({n})",
            f"{share:.0%} of a core",
            f"bound {CORE_SHARE:.0%}",
            share <= CORE_SHARE,
        ),
        (
            f"per-node heartbeats: p99 ({n})",
            f"{p99} ms",
            f"bound {HEARTBEAT_P99_MS:g} ms",
            p99 <= HEARTBEAT_P99_MS,
        ),
        (f"a page of 500 groups ({n})", f"{page} ms", f"bound {PAGE_MS:g} ms", page <= PAGE_MS),
        (f"status page ({n})", f"{status} KiB", "bound 1 MB", status <= STATUS_KIB),
        (
            f"restart serving again ({n})",
            f"{restart} s",
            f"bound {RESTART_S:g} s",
            restart <= RESTART_S,
        ),
    ]
    for r in f.get("rows", {}).get("etcd", []):
        if not _ok(r):
            out.append(
                (
                    f"3-member etcd, {r.get('ranks', 0):,} ranks: errors; leases",
                    str(r.get("failed", "failed"))[:80],
                    "one a node",
                    False,
                )
            )
        else:
            errors = r["launch"]["errors"] + sum(
                v for k, v in r["steady"]["statuses"].items() if not k.endswith(" 200")
            )
            out.append(
                (
                    f"3-member etcd, {r['ranks']:,} ranks: errors; leases",
                    f"{errors}; {r['store']['leases']:,} leases",
                    f"one a node: {r['groups']:,}",
                    errors == 0 and r["store"]["leases"] == r["groups"],
                )
            )
    return out


def _row(store: str, r: dict[str, Any]) -> str:
    if not _ok(r):
        return f"| {store} | {r.get('ranks', '?'):,} | failed: {r.get('failed', '?')} |"
    s, reads = r["steady"], r["reads"]
    status = (
        f"{reads['status_kib']} KiB, {reads['status_ms']:.0f} ms"
        + (f"; again {reads['status_again_ms']:.0f} ms" if "status_again_ms" in reads else "")
        if reads.get("status_code", 200) == 200
        else f"answered {reads['status_code']}"
    )
    if "metrics_ms" in reads:
        status += "; /metrics " + ", ".join(f"{t:.0f}" for t in reads["metrics_ms"]) + " ms"
    size = (
        f"{r['store']['bytes'] / 2**20:.0f} MiB"
        if "bytes" in r["store"]
        else f"{max(r['store']['db_mib'])} MiB ({r['store']['leases']:,} leases)"
    )
    return (
        f"| {store} | {r['ranks']:,} | {r['launch']['ready_s']} s | "
        f"{s['server_core_share']:.1%} ({s['server_cpu_us_per_request']} µs/req) | "
        f"{s['heartbeat']['p50_ms']} / {s['heartbeat']['p99_ms']} ms | "
        f"{s['handshake']['p99_ms']} ms | {s['client_lag']['p99_ms']} ms | "
        f"{r['rss_mib']['steady']} MiB | {size} | {_pages(reads)} | "
        f"{status} | {r['restart']['serving_s']} s |"
    )


def _pages(reads: dict[str, Any]) -> str:
    """The slowest page of the first walk, and of the second where the run made one."""
    first = f"{max(reads['page_500_ms'])} ms"
    again = reads.get("page_500_again_ms")
    return f"{first}; again {max(again)} ms" if again else first


def blobs(f: dict[str, Any]) -> str:
    """What the ranks registered: real NIXL agents' metadata (``--blob nixl``) or random bytes
    (``random``, and every run before the choice was recorded)."""
    if f.get("blob") == "nixl":
        return "real NIXL agents' metadata on DRAM"
    return f"{f.get('blob_bytes', '?')}-byte random blobs"


def table(f: dict[str, Any]) -> list[str]:
    lines = [
        "### A fleet on one registry (bench/fleet.py)",
        "",
        f"TP 8 groups, {blobs(f)} ({f.get('regions', '?')} NIXL "
        f"regions a rank), per-node heartbeats every 10 s, {f.get('handshakes_per_s', '?')} "
        f"handshakes/s; load average {' '.join(f.get('load_average', []))} at the end.",
        "",
        "| store | ranks | ready | server CPU, steady | heartbeat p50 / p99 | handshake p99 "
        "| client lag p99 | RSS | store | page of 500 (slowest; a second walk) | status page "
        "(and /metrics, twice) | restart |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for store, rows in f.get("rows", {}).items():
        lines += [_row(store, r) for r in rows]
    c = f.get("ceiling")
    if c:
        lines += [
            "",
            f"The client's own ceiling (the same steady state at {c['ranks']:,} ranks against "
            f"a server that does no work): heartbeat p99 {c['heartbeat']['p99_ms']} ms, client "
            f"lag p99 {c['client_lag']['p99_ms']} ms, client CPU {c['client_cpu_share']:.0%} "
            "of a core"
            + (
                f"; that server (uvicorn with the registry's settings, a bare ASGI callable) "
                f"{c['server_core_share']:.1%} of a core, {c['server_cpu_us_per_request']} "
                "µs a request: the floor of any request through uvicorn."
                if "server_core_share" in c
                else "."
            ),
        ]
        p = c.get("protocol")
        if p:
            lines.append(
                "An asyncio protocol with httptools and no uvicorn (`bench.minimal protocol`, "
                "the floor of the registry's wire path) at the same pace: "
                f"{p['server_core_share']:.1%} of a core, {p['server_cpu_us_per_request']} µs "
                f"a request (heartbeat p99 {p['heartbeat']['p99_ms']} ms)."
            )
    for store, why in f.get("skipped", {}).items():
        lines.append(f"{store}: skipped ({why}).")
    return [*lines, ""]
