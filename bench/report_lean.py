"""The request-path question's table and targets (``bench/lean.py``)."""

from __future__ import annotations

from typing import Any

Target = tuple[str, str, str, bool | None]

LABELS = {
    "registry": "registry (SQLite), uvicorn",
    "registry_granian": "registry (SQLite), Granian",
    "floor": "framework floor: same routes and models, no work (uvicorn)",
    "etcd_direct": "etcd direct (aetcd)",
    "registry_batched": "registry (SQLite), batched routes, uvicorn",
}


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and "failed" not in row  # type: ignore[operator]


def table(lean: dict[str, Any]) -> list[str]:
    lines = [
        "### The request-path storm (as the issue states it: TP 8 groups, half prefill, 17 "
        "requests per group, 4 KiB agents, 64 requests in flight; median of "
        f"{lean['rounds']} interleaved rounds by ready time)",
        "",
        "| system | ranks | ready (s) | ranks/s | vs etcd direct | requests | req/s | "
        "server CPU ms/req | event loop / SQLite thread CPU (s) | client CPU (s) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for n, rows in lean["rows"].items():
        etcd = rows.get("etcd_direct")
        for system, label in LABELS.items():
            row = rows.get(system)
            if not _ok(row):
                lines.append(f"| {label} | {int(n):,} | failed: {(row or {}).get('failed')} |")
                continue
            assert row is not None
            ratio = (
                f"{row['ranks_per_s'] / etcd['ranks_per_s']:.2f}"
                if _ok(etcd) and etcd is not row
                else "-"
            )
            threads = row.get("server_threads_cpu_s", {})
            split = (
                f"{threads['event_loop']:.2f} / {threads['other_threads']:.2f}"
                if system in ("registry", "registry_batched") and threads
                else "-"
            )
            lines.append(
                f"| {label} | {int(n):,} | {row['ready_s']:.2f} | {row['ranks_per_s']:,.0f} | "
                f"{ratio} | {row['requests']:,} | {row['requests_per_s']:,.0f} | "
                f"{row.get('server_cpu_ms_per_request', '-')} | {split} | "
                f"{row.get('client_cpu_s', '-')} | {row['errors'] or 'none'} |"
            )
    lines += [
        "",
        "Every round's figures are in `bench/results/lean.json`. The client is one aiohttp "
        "process (the same for every HTTP row); its ceiling is in the ceilings table below.",
        "",
    ]
    return lines


def vs_etcd(label: str, ours: dict[str, Any], etcd: dict[str, Any]) -> Target:
    """A target row: our ranks/s against etcd direct's in the same storm, met at ratio ≥ 1."""
    ratio = ours["ranks_per_s"] / etcd["ranks_per_s"]
    shown = f"{ours['ranks_per_s']:,.0f} vs {etcd['ranks_per_s']:,.0f} ranks/s"
    return (label, shown, f"ratio {ratio:.2f}", ratio >= 1.0)


def linear(label: str, small: dict[str, Any], big: dict[str, Any]) -> Target:
    """A target row: the larger storm's ranks/s within 10% of the smaller's, with no errors."""
    ratio = big["ranks_per_s"] / small["ranks_per_s"]
    shown = (
        f"{big['ranks_per_s']:,.0f} vs {small['ranks_per_s']:,.0f} ranks/s, errors "
        f"{sum(big['errors'].values())}"
    )
    return (label, shown, f"ratio {ratio:.2f}", ratio >= 0.9 and not big["errors"])


def targets(lean: dict[str, Any]) -> list[Target]:
    """The request-path issue's goals, judged on its own storm."""
    out: list[Target] = []
    rows = lean.get("rows", {})
    small, big = rows.get("1024", {}), rows.get("4096", {})
    reg = small.get("registry")
    if _ok(reg):
        out.append(
            (
                "issue's storm: 1,024 ranks ready on SQLite ≤ 2 s",
                f"{reg['ready_s']:.2f} s",
                f"{2 / reg['ready_s']:.2f}x of target",
                reg["ready_s"] <= 2.0,
            )
        )
    for n, size in (("1,024", small), ("4,096", big)):
        ours, etcd = size.get("registry"), size.get("etcd_direct")
        if _ok(ours) and _ok(etcd):
            out.append(vs_etcd(f"issue's storm: ranks/s ≥ etcd direct ({n} ranks)", ours, etcd))
    large = big.get("registry")
    if _ok(reg) and _ok(large):
        label = "issue's storm: 4,096 ranks, no errors, ranks/s within 10% of 1,024"
        out.append(linear(label, reg, large))
    if _ok(reg):
        ms = reg["server_cpu_ms_per_request"]
        out.append(
            (
                "issue's storm: server CPU per request ≤ 0.35 ms (1,024 ranks)",
                f"{ms:.3f} ms",
                f"{0.35 / ms:.2f}x of target",
                ms <= 0.35,
            )
        )
    batched = small.get("registry_batched")
    if _ok(batched):
        per_group = batched["requests"] / batched["groups"]
        out.append(
            (
                "issue's storm, batched: ≤ 4 requests per group, 1,024 ranks ready ≤ 0.5 s",
                f"{per_group:.1f} per group, ready {batched['ready_s']:.2f} s",
                f"{0.5 / batched['ready_s']:.2f}x of target",
                per_group <= 4 and batched["ready_s"] <= 0.5,
            )
        )
    return out
