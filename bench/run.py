"""``python -m bench.run [--quick] [--only storm,handshake,transfer,soak] [--report-only]``: run
the benchmarks, write ``bench/results/<name>.json`` and the table ``bench/results/latest.md``.

``--quick`` (under about a minute) runs the smallest storm and few iterations: a smoke test of
the benchmarks themselves, written to ``bench/results/quick/``, not figures to publish.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench import report_decoders
from bench.common import RESULTS, machine, say, wait_quiet, write_result
from bench.report import markdown

QUESTIONS = (
    "lean",
    "storm",
    "lookups",
    "handshake",
    "transfer",
    "soak",
    "watch",
    "fleet",
    "feed_lag",
    "decoders",
    "overload",
    "replica_kill",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (~1 minute)")
    parser.add_argument("--only", default=",".join(QUESTIONS), help="comma-separated subset")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="seconds to wait for other processes to go idle before each question "
        "(default 120, 0 with --quick)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild latest.md from the JSON results"
    )
    args = parser.parse_args(argv)
    chosen = [] if args.report_only else [q.strip() for q in args.only.split(",") if q.strip()]
    unknown = set(chosen) - set(QUESTIONS)
    if unknown:
        parser.error(f"unknown question(s) {sorted(unknown)}; choose from {QUESTIONS}")
    # Smoke tests never overwrite the published results.
    out = RESULTS / "quick" if args.quick else RESULTS
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0 if args.quick else 120)

    info = machine()
    if args.report_only:  # the machine of the run that made the results
        first = next(out / f"{q}.json" for q in QUESTIONS if (out / f"{q}.json").exists())
        info = json.loads(first.read_text())["machine"]
    say(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"Python {info['python']}"
    )
    results: dict[str, Any] = {}
    for name in QUESTIONS:
        if name not in chosen:
            previous = out / f"{name}.json"
            if previous.exists():
                results[name] = json.loads(previous.read_text())
            continue
        busy = wait_quiet(quiet_wait)
        say(f"{name}: starting (machine {busy:.0%} busy beforehand)")
        t0 = time.monotonic()
        module = importlib.import_module(f"bench.{name}")
        data = module.run(quick=args.quick)
        data |= {
            "question": name,
            "quick": args.quick,
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - t0, 1),
            "busy_before": busy,
            "machine": info,
        }
        path = write_result(name, data, out)
        say(f"{name}: done in {data['seconds']} s -> {path.relative_to(RESULTS.parents[1])}")
        results[name] = data
    table = markdown(results, info)
    if "decoders" in results:
        table += "\n" + "\n".join(report_decoders.table(results["decoders"]))
    (out / "latest.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
