"""The watch question's tables (``bench/watch.py``) for ``bench/results/latest.md``."""

from __future__ import annotations

from typing import Any

FANOUT_P99_MS = {"sqlite": 100.0, "etcd": 250.0}  # the bounds, one change to all


def _v(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value}"


def targets(w: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    out: list[tuple[str, str, str, bool | None]] = []
    for store, bound in FANOUT_P99_MS.items():
        row = w.get("fanout", {}).get(store)
        if row:
            out.append(
                (
                    f"one change reaches {row['watchers']:,} watchers, p99 ({store})",
                    f"{row['p99_ms']} ms",
                    f"bound {bound:g} ms",
                    row["p99_ms"] <= bound,
                )
            )
    storm = w.get("storm")
    if storm:
        out.append(
            (
                f"launch storm ({storm['ranks']:,} ranks) with {storm['watchers']} watchers",
                f"{storm['watched_ranks_per_s']} vs {storm['none_ranks_per_s']} ranks/s",
                f"{storm['ratio']}x (bound 0.9x)",
                storm["ratio"] >= 0.9,
            )
        )
    return out


def table(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    fan = w.get("fanout", {})
    if fan:
        lines += [
            "### Watch fan-out (one replica, one change at a time; from the write's send to "
            "each watcher's line; aiohttp client)",
            "",
            "| store | watchers | changes | p50 ms | p99 ms | max ms | server CPU µs per line "
            "(write included) | client CPU µs per line |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, label in (
            ("sqlite", "SQLite"),
            ("etcd", "etcd"),
            ("client_ceiling", "client ceiling (raw asyncio server, no work)"),
        ):
            row = fan.get(name)
            if row:
                lines.append(
                    f"| {label} | {row['watchers']:,} | {row['changes']} | {row['p50_ms']} | "
                    f"{row['p99_ms']} | {row['max_ms']} | {_v(row['server_cpu_us_per_line'])} | "
                    f"{row['client_cpu_us_per_line']} |"
                )
        lines.append("")
    storm = w.get("storm")
    if storm:
        lines += [
            f"### The launch storm with watchers (bench/storm_lean.py, {storm['ranks']:,} ranks, "
            f"SQLite; {storm['watchers']} watchers in another process reading every line; "
            f"median of {storm['rounds']} interleaved rounds)",
            "",
            "| | ranks/s | server CPU s | watch lines per storm |",
            "|---|---:|---:|---:|",
            f"| no watcher | {storm['none_ranks_per_s']} | {storm.get('none_server_cpu_s', '-')} "
            "| 0 |",
            f"| {storm['watchers']} watchers | {storm['watched_ranks_per_s']} | "
            f"{storm.get('watched_server_cpu_s', '-')} | "
            f"{max(storm['lines_per_watched_storm'] or [0]):,} |",
            "",
            "On 2 cores the watchers' own client (parsing every line) competes with the server "
            "and the storm's client: the server CPU column is the registry's own cost.",
            "",
        ]
    lst = w.get("list")
    if lst:
        rss = lst["rss_mib"]
        lines += [
            f"### A paged list ({lst['groups']:,} TP {lst['tp']} groups, every rank registered; "
            f"SQLite; limit {lst['limit']})",
            "",
            "| pages | page p50 ms | page max ms | page KiB p50 | page KiB max | whole walk s | "
            "unpaged list s | unpaged MiB | server RSS MiB: empty / populated / after walk / "
            "after unpaged |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {lst['pages']} | {lst['page_p50_ms']} | {lst['page_max_ms']} | "
            f"{lst['page_kib_p50']} | {lst['page_kib_max']} | {lst['walk_s']} | "
            f"{lst['unpaged_s']} | {lst['unpaged_mib']} | {rss['empty']} / {rss['populated']} "
            f"/ {rss['after_walk']} / {rss['after_unpaged']} |",
            "",
        ]
    return lines
