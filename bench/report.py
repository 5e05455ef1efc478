"""The markdown table of ``bench/results/latest.md``, with each figure against its target."""

from __future__ import annotations

from typing import Any

from bench import report_fleet, report_lean, report_watch, soak

OPS = ("open", "get_engine", "register", "heartbeat", "handshake", "wait_ready")


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _ops(row: dict[str, Any], op: str) -> str:
    s = row["ops"].get(op)
    return "-" if not s else f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f}"


def _machine(info: dict[str, Any]) -> list[str]:
    v = info["versions"]
    return [
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"{info['os']}; Python {info['python']}; commit {info['git']}.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val != "-") + ".",
        "",
    ]


def _cpu_per_request(row: dict[str, Any]) -> str:
    cpu = row.get("server_cpu_s")
    return f"{cpu / row['requests'] * 1000:.2f}" if cpu else "-"


def _ratios(s: dict[str, Any]) -> list[str]:
    """Our storm throughput as a ratio to each baseline, size by size."""
    c = s.get("ceilings", {}).get("fastapi")
    lines = [
        "### Storm throughput as a ratio to the baselines",
        "",
        "| store | ranks | ranks/s vs etcd direct | req/s vs FastAPI PUT ceiling (aiohttp) "
        "| req/s vs FastAPI GET ceiling (wrk) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label in (("registry_sqlite", "SQLite"), ("registry_etcd", "etcd")):
        for n, row in s.get(key, {}).items():
            if "failed" in row:
                continue
            base = s.get("etcd_direct", {}).get(n, {})
            vs_etcd = (
                f"{row['ranks_per_s'] / base['ranks_per_s']:.2f}" if "ranks_per_s" in base else "-"
            )
            put = get = "-"
            if c:
                put = f"{row['requests_per_s'] / c['put_aiohttp']['requests_per_s']:.2f}"
                get = f"{row['requests_per_s'] / c['get_wrk_rps']:.2f}"
            lines.append(f"| {label} | {int(n):,} | {vs_etcd} | {put} | {get} |")
    return [*lines, ""]


def _storm(s: dict[str, Any]) -> list[str]:
    lines = [
        f"### The heavier launch storm (4-256 KiB agents; TP {s['tp']}, half prefill / half "
        "decode groups, heartbeats every "
        f"{s['heartbeat_s']} s; p50 / p99 ms per operation, client-side)",
        "",
        "| system | ranks | ready (s) | ranks/s to ready | all handshakes (s) | req/s | "
        "server CPU ms/req | " + " | ".join(OPS) + " | errors |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(OPS) + "---|",
    ]
    names = {
        "registry_sqlite": "registry, SQLite",
        "registry_sqlite_paced": f"registry, SQLite, launches paced over {s.get('paced_s', 8):g} s",
        "registry_sqlite_batched": "registry, SQLite, batched routes (a leader per group)",
        "registry_etcd": "registry, etcd",
        "etcd_direct": "etcd direct (aetcd)",
    }
    for key, label in names.items():
        for n, row in s.get(key, {}).items():
            if "failed" in row:
                lines.append(f"| {label} | {int(n):,} | failed: {row['failed']} |")
                continue
            errors = ", ".join(f"{k}: {v}" for k, v in row["errors"].items()) or "none"
            lines.append(
                f"| {label} | {int(n):,} | {row['ready_s']:.2f} | {row['ranks_per_s']:,.0f} | "
                f"{row['handshakes_done_s']:.2f} | {row['requests_per_s']:,.0f} | "
                f"{_cpu_per_request(row)} | "
                + " | ".join(_ops(row, op) for op in OPS)
                + f" | {errors} |"
            )
    lines += [
        "",
        "etcd direct: `lease grant` + `put` per agent (the register column shows the put; "
        "`lease_grant` p50/p99 is in the JSON), `get` per engine fetch and per handshake, "
        "`lease refresh` per heartbeat; readiness is signalled in-process for free, nothing is "
        "checked (no engine identity, no compat, no fencing of old launches).",
        "",
    ]
    for note in s.get("notes", []):
        lines.append(f"Note: {note}.")
    c = s.get("ceilings", {})
    if c:
        raw, fa = c["raw"], c["fastapi"]
        lines += [
            "",
            "### Ceilings (same uvicorn settings, concurrency 64)",
            "",
            "| server | request | aiohttp req/s | aiohttp p50 / p99 ms | wrk req/s |",
            "|---|---|---:|---:|---:|",
            f"| bare ASGI (client ceiling) | GET | {raw['get_aiohttp']['requests_per_s']:,.0f} | "
            f"{raw['get_aiohttp']['p50_ms']:.1f} / {raw['get_aiohttp']['p99_ms']:.1f} | "
            f"{raw['get_wrk_rps']:,.0f} |",
            f"| minimal FastAPI | GET | {fa['get_aiohttp']['requests_per_s']:,.0f} | "
            f"{fa['get_aiohttp']['p50_ms']:.1f} / {fa['get_aiohttp']['p99_ms']:.1f} | "
            f"{fa['get_wrk_rps']:,.0f} |",
            f"| minimal FastAPI | PUT agent body (~{c.get('put_body_kib', '?')} KiB) | "
            f"{fa['put_aiohttp']['requests_per_s']:,.0f} | "
            f"{fa['put_aiohttp']['p50_ms']:.1f} / {fa['put_aiohttp']['p99_ms']:.1f} | "
            f"{fa['put_wrk_rps']:,.0f} |",
            "",
        ]
    return lines


def _handshake(h: dict[str, Any]) -> list[str]:
    lines = [
        f"### Handshake (prefill TP {h['prefill_tp']}, real NIXL agents, metadata "
        f"{min(h['metadata_bytes'])}-{max(h['metadata_bytes'])} B; {h['iterations']} per row; "
        "ms)",
        "",
        "| decode TP | agents loaded | registry p50 / p99 | NIXL add_remote_agent p50 / p99 "
        "| total p50 / p99 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in h["rows"]:
        lines.append(
            f"| {r['decode_tp']} | {r['targets_per_rank']} | "
            f"{r['registry']['p50_ms']:.2f} / {r['registry']['p99_ms']:.2f} | "
            f"{r['nixl']['p50_ms']:.2f} / {r['nixl']['p99_ms']:.2f} | "
            f"{r['total']['p50_ms']:.2f} / {r['total']['p99_ms']:.2f} |"
        )
    return [*lines, ""]


def _transfer(t: dict[str, Any]) -> list[str]:
    lines = [
        f"### Transfer (NIXL READ, DRAM to DRAM between two processes, "
        f"{t['bytes_per_transfer'] // 2**20} MiB per transfer, UCX_TLS {t['ucx_tls']}; GB/s)",
        "",
        "| block | descriptors | READ best | READ median | memcpy | READ / memcpy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in t["rows"]:
        b = r["block_bytes"]
        size = f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"
        lines.append(
            f"| {size} | {r['blocks']:,} | {r['read_gbps_best']:.2f} | "
            f"{r['read_gbps_median']:.2f} | {r['memcpy_gbps']:.2f} | {r['ratio']:.2f} |"
        )
    return [*lines, ""]


def targets(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(target, figure, ratio to target, met) for every target the run can judge."""
    out: list[tuple[str, str, str, bool | None]] = report_lean.targets(results.get("lean", {}))
    s = results.get("storm", {})
    row = s.get("registry_sqlite", {}).get("1024")
    if row and "failed" not in row:
        out.append(
            (
                "heavy storm: 1,024 ranks ready on SQLite ≤ 2 s",
                f"{row['ready_s']:.2f} s",
                f"{2 / row['ready_s']:.2f}x of target",
                row["ready_s"] <= 2.0,
            )
        )
        p99 = row["target_ops_p99_ms"]
        out.append(
            (
                "heavy storm: per-op p99 ≤ 50 ms at 1,024 ranks (SQLite)",
                f"{p99:.1f} ms (worst op)",
                f"{50 / p99:.2f}x of target",
                p99 <= 50.0,
            )
        )
    paced = s.get("registry_sqlite_paced", {}).get("1024")
    if paced and "failed" not in paced:
        p99 = paced["target_ops_p99_ms"]
        out.append(
            (
                f"(same, 1,024 ranks launching over {s.get('paced_s', 8):g} s instead of at once)",
                f"{p99:.1f} ms (worst op)",
                f"{50 / p99:.2f}x of target",
                p99 <= 50.0,
            )
        )
    for n, ours in s.get("registry_sqlite", {}).items():
        base = s.get("etcd_direct", {}).get(n)
        if base and "failed" not in base and "failed" not in ours:
            label = f"heavy storm: ranks/s ≥ etcd direct ({int(n):,} ranks)"
            out.append(report_lean.vs_etcd(label, ours, base))
    out += _request_path_targets(results)
    out += report_watch.targets(results.get("watch", {}))
    out += report_fleet.targets(results.get("fleet", {}))
    h = results.get("handshake", {})
    for r in h.get("rows", []):
        if r["decode_tp"] == 8:
            p50 = r["registry"]["p50_ms"]
            out.append(
                (
                    "handshake plan p50 ≤ 5 ms (decode TP 8 vs prefill TP 8)",
                    f"{p50:.2f} ms",
                    f"{5 / p50:.2f}x of target",
                    p50 <= 5.0,
                )
            )
    t = results.get("transfer", {})
    big = [r for r in t.get("rows", []) if r["block_bytes"] >= 2**20]
    if big:
        worst = min(big, key=lambda r: r["ratio"])
        out.append(
            (
                "NIXL READ ≥ 0.8 x memcpy for blocks ≥ 1 MiB",
                f"worst {worst['ratio']:.2f} ({worst['block_bytes'] // 2**20} MiB blocks)",
                f"{worst['ratio'] / 0.8:.2f}x of target",
                worst["ratio"] >= 0.8,
            )
        )
    return out


def _request_path_targets(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """Issue 16's goals: the request path at the framework's own cost."""
    out: list[tuple[str, str, str, bool | None]] = []
    s = results.get("storm", {})
    sqlite = s.get("registry_sqlite", {})
    small, big = sqlite.get("1024"), sqlite.get("4096")
    if small and big and "failed" not in small and "failed" not in big:
        label = "heavy storm: 4,096 ranks on SQLite, no errors, ranks/s within 10% of 1,024"
        out.append(report_lean.linear(label, small, big))
    if small and "failed" not in small and small.get("server_cpu_s"):
        ms = small["server_cpu_s"] / small["requests"] * 1000
        out.append(
            (
                "heavy storm: server CPU per request ≤ 0.35 ms (1,024 ranks, SQLite)",
                f"{ms:.2f} ms",
                f"{0.35 / ms:.2f}x of target",
                ms <= 0.35,
            )
        )
    batched = s.get("registry_sqlite_batched", {}).get("1024")
    if batched and "failed" not in batched:
        per_group = batched["requests"] / batched["groups"]
        out.append(
            (
                "heavy storm, batched: ≤ 4 requests per group, 1,024 ranks ready ≤ 0.5 s",
                f"{per_group:.1f} per group, ready {batched['ready_s']:.2f} s",
                f"{0.5 / batched['ready_s']:.2f}x of target",
                per_group <= 4 and batched["ready_s"] <= 0.5,
            )
        )
    etcd4k, sqlite4k = s.get("registry_etcd", {}).get("4096"), sqlite.get("4096")
    if etcd4k is not None:
        ok = "failed" not in etcd4k and not etcd4k.get("errors")
        ratio = (
            etcd4k["ranks_per_s"] / sqlite4k["ranks_per_s"]
            if ok and sqlite4k and "failed" not in sqlite4k
            else 0.0
        )
        out.append(
            (
                "heavy storm: etcd store, 4,096 ranks, 0 errors, ≥ 0.5x the SQLite store's ranks/s",
                etcd4k.get("failed", f"{etcd4k.get('ranks_per_s', 0):,.0f} ranks/s")[:80],
                f"ratio {ratio:.2f}",
                ok and ratio >= 0.5,
            )
        )
    lookups = results.get("lookups", {})
    for row in ("get_engine", "handshake", "heartbeat"):
        r = lookups.get(row)
        if r:
            out.append(
                (
                    f"{row} ≥ 0.7x a minimal FastAPI GET (wrk -c32)",
                    f"{r['rps']:,.0f} vs {lookups['fastapi_get']['rps']:,.0f} req/s",
                    f"ratio {r['vs_fastapi_get']:.2f}",
                    r["vs_fastapi_get"] >= 0.7,
                )
            )
    return out


def _lookups(lk: dict[str, Any]) -> list[str]:
    lines = [
        f"### Hot routes one at a time (wrk, {lk['wrk_connections']} connections; TP "
        f"{lk['tp']} group, {lk['blob_bytes']} B blobs)",
        "",
        "| server | route | req/s | server CPU ms/req | vs minimal FastAPI GET |",
        "|---|---|---:|---:|---:|",
        f"| bare ASGI (client ceiling) | GET /ping | {lk['raw_get']['rps']:,.0f} | "
        f"{lk['raw_get']['server_cpu_ms']:.3f} | - |",
        f"| minimal FastAPI | GET /ping | {lk['fastapi_get']['rps']:,.0f} | "
        f"{lk['fastapi_get']['server_cpu_ms']:.3f} | 1.00 |",
    ]
    for row, label in (
        ("get_engine", "GET /tp-groups/{g}/engine"),
        ("handshake", "POST /engines/{id}/handshake"),
        ("heartbeat", "POST …/agents/{rank}/heartbeat"),
    ):
        r = lk[row]
        lines.append(
            f"| registry | {label} | {r['rps']:,.0f} | {r['server_cpu_ms']:.3f} | "
            f"{r['vs_fastapi_get']:.2f} |"
        )
    return [*lines, ""]


def markdown(results: dict[str, Any], info: dict[str, Any]) -> str:
    quick = any(r.get("quick") for r in results.values())
    lines = ["## Benchmarks", ""]
    if quick:
        lines += ["**Quick run (smoke-test sizes): not figures to publish.**", ""]
    lines += _machine(info)
    reused = [
        f"{name} (run of {r.get('when', '?')}, {r['machine']['cpu']}, commit {r['machine']['git']})"
        for name, r in results.items()
        if r.get("machine", {}).get("git") not in (None, info.get("git"))
    ]
    if reused:
        lines += [
            "Reused from an earlier run, not re-measured here: " + "; ".join(reused) + ".",
            "",
        ]
    busy = {k: r.get("busy_before") for k, r in results.items()}
    lines += [
        "Machine busy before each question (other processes): "
        + ", ".join(f"{k} {v:.0%}" for k, v in busy.items() if v is not None)
        + ".",
        "",
    ]
    rows = targets(results)
    if rows:
        lines += ["### Against the targets", "", "| target | measured | ratio | met |"]
        lines += ["|---|---|---|---|"]
        for name, figure, ratio, met in rows:
            lines.append(f"| {name} | {figure} | {ratio} | {'yes' if met else 'no'} |")
        lines.append("")
    if "lean" in results:
        lines += report_lean.table(results["lean"])
    if "storm" in results:
        lines += _storm(results["storm"])
        lines += _ratios(results["storm"])
    if "lookups" in results:
        lines += _lookups(results["lookups"])
    if "handshake" in results:
        lines += _handshake(results["handshake"])
    if "transfer" in results:
        lines += _transfer(results["transfer"])
    if "soak" in results:
        lines += soak.section(results["soak"])
    if "watch" in results:
        lines += report_watch.table(results["watch"])
    if "fleet" in results:
        lines += report_fleet.table(results["fleet"])
    return "\n".join(lines).rstrip() + "\n"
