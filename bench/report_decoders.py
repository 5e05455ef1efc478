"""The decoders question (``bench/decoders.py``): what its streams saw, checked against the
writer's known generations, and its markdown table for ``bench/results/latest.md``."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.common import pct

P99_BOUND_MS = 1000.0  # issue 38: a prefill relaunch reaches every stream, p99 <= 1 s

Write = tuple[str, int, float]  # group id, generation, when its answer came (monotonic)


def _ms(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1000, 1),
        "p99_ms": round(pct(values, 99) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


def latencies(streams: list[list[list[Any]]], writes: list[Write]) -> dict[str, Any]:
    """From each write's answer to each stream's line of it (the first, not a relist)."""
    out: list[float] = []
    missing = 0
    for records in streams:
        seen = {(r[3], r[4]): r[0] for r in records if r[1] != "S"}
        for gid, gen, answered in writes:
            t = seen.get((gid, gen))
            if t is None:
                missing += 1
            else:
                out.append(t - answered)
    return _ms(out) | {"missing": missing, "lines": len(out)}


def by_revision(streams: list[list[list[Any]]], answers: list[float]) -> dict[str, Any]:
    """The ceiling server's k-th PUT is its revision k."""
    out = [r[0] - answers[r[2] - 1] for rs in streams for r in rs if 0 < r[2] <= len(answers)]
    return _ms(out) | {"lines": len(out), "expected": len(answers) * len(streams)}


def exactly_once(streams: list[list[list[Any]]], writes: list[Write]) -> dict[str, Any]:
    """Each stream saw each written generation once, in order; a relist (``S``) covers the
    generations up to the one it shows. Behind: a stream whose last word on some group is
    not the writer's last when the wait ended (not caught up yet: its writes are not counted
    as lost); lost: on a caught-up stream, a generation written, never seen and not covered
    by a relist; repeated: a line of a generation the stream already knew."""
    final: dict[str, int] = {}
    for gid, gen, _ in writes:
        final[gid] = max(gen, final.get(gid, 0))
    lost = repeated = behind = 0
    for records in streams:
        known: dict[str, int] = {}
        events: set[tuple[str, int]] = set()
        synced: dict[str, int] = {}
        for _, kind, _, gid, gen in records:
            if kind == "S":
                synced[gid] = max(gen, synced.get(gid, 0))
                known[gid] = max(gen, known.get(gid, 0))
                continue
            if gen <= known.get(gid, 0):
                repeated += 1
            known[gid] = max(gen, known.get(gid, 0))
            events.add((gid, gen))
        if any(known.get(gid, 0) != gen for gid, gen in final.items()):
            behind += 1
            continue
        for gid, gen, _ in writes:
            if (gid, gen) not in events and synced.get(gid, 0) < gen:
                lost += 1
    return {"lost": lost, "repeated": repeated, "behind_streams": behind}


def reconnects(
    attempts: list[float], opens: list[list[float]], t_kill: float, t_up: float
) -> dict[str, Any]:
    """The tries after the kill, the most in any one second, and when every stream was back
    (its last open; a stream whose last open came before the kill never dropped)."""
    after = [t - t_kill for t in attempts if t >= t_kill]
    per_second = Counter(int(t) for t in after)
    last = [max(bs) if bs and max(bs) >= t_kill else None for bs in opens]
    back = [t for t in last if t is not None]
    return {
        "tries": len(after),
        "max_per_second": max(per_second.values(), default=0),
        "tries_per_second": [per_second.get(s, 0) for s in range(max(per_second, default=-1) + 1)],
        "streams_back": len(back),
        "streams_not_reopened": len(last) - len(back),
        "all_back_after_kill_s": round(max(back) - t_kill, 2) if back else None,
        "all_back_after_serving_s": round(max(back) - t_up, 2) if back else None,
        "p50_back_after_serving_s": round(pct([t - t_up for t in back], 50), 2) if back else None,
    }


def _row(store: str, r: dict[str, Any]) -> str:
    if "relaunch" not in r or "ceiling" not in r:
        return f"| {store} | {r['ranks']:,} | failed: {r.get('failed', '?')[:120]} |"
    rel, ceil, st = r["relaunch"], r["ceiling"], r["steady"]
    rs = r["restart"]
    check, rec = rs["check"], rs["reconnects"]
    if r.get("resume_at_error") or not rs.get("writes_in_shutdown", True):
        modes = ["no write in the shutdown"] if not rs.get("writes_in_shutdown", True) else []
        modes += ["resumed at the ERROR line"] if r.get("resume_at_error") else []
        store = f"{store} ({', '.join(modes)})"
    behind = check["behind_streams"]
    back = f"not all: {behind:,} behind" if behind else rec["all_back_after_serving_s"]
    return (
        f"| {store} | {r['ranks']:,} | {r['streams']:,} | {rel['p50_ms']} / {rel['p99_ms']} / "
        f"{rel['max_ms']} ({rel['missing']} missing) | {ceil['relaunch'].get('p99_ms')} | "
        f"{st['without']['server_core_share']} → {st['with']['server_core_share']} | "
        f"{st['without']['rss_mib']} → {st['with']['rss_mib']} | {st['kib_per_stream']} | "
        f"{check['lost']:,} / {check['repeated']:,} / {behind:,} | "
        f"{rs['relists']:,} | {rec['max_per_second']:,} | {back} | "
        f"{st['with']['client_core_share']} / {rel['client_lag_p99_ms']} |"
    )


def table(d: dict[str, Any]) -> list[str]:
    lines = [
        "### Decoders following the registry (one stream a decode node)",
        "",
        "| store | ranks | streams | relaunch → every stream p50 / p99 / max ms | client "
        "ceiling p99 ms | registry core share (no streams → streams) | RSS MiB | KiB a "
        "stream | restart: lost / repeated / streams behind | relists | most reconnects in "
        "1 s | all back s | client core share / lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for store, rows in d.get("rows", {}).items():
        lines += [_row(store, r) for r in rows]
    return [*lines, ""]


def targets(d: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    out: list[tuple[str, str, str, bool | None]] = []
    for store, rows in d.get("rows", {}).items():
        for r in rows:
            if "relaunch" in r:
                p99 = r["relaunch"]["p99_ms"]
                what = f"a relaunch reaches {r['streams']:,} streams, p99 ({store}, {r['ranks']:,})"
                out.append((what, f"{p99} ms", f"bound {P99_BOUND_MS:g} ms", p99 <= P99_BOUND_MS))
    return out
