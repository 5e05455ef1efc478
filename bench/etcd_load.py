"""``python -m bench.etcd_load [--ranks 1024,4096] [--sqlite]``: the launch storm of
``bench.storm`` against a registry on a fresh single-member etcd (and, with ``--sqlite``, on
SQLite in the same run, as the baseline), with the server process watched while it runs.

Prints one JSON line per row: the storm's figures (or why it failed) plus what the server
process looked like at its worst (open file descriptors, threads, RSS, TCP connections to
etcd) and the tail of the registry's and etcd's logs when something failed. Nothing is
written under bench/results: this is a diagnosis tool for the etcd store under load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import registry_server, say
from bench.storm_http import http_storm


def _sample(pid: int) -> dict[str, int]:
    proc = Path(f"/proc/{pid}")
    try:
        fds = len(os.listdir(proc / "fd"))
        status = (proc / "status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "fds": fds,
        "threads": int(fields["Threads"].strip()),
        "rss_mib": int(fields["VmRSS"].split()[0]) // 1024,
    }


class Watcher(threading.Thread):
    """Samples a process every ``interval_s`` and keeps the maxima."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            for key, value in _sample(self.pid).items():
                self.peak[key] = max(self.peak.get(key, 0), value)


def _tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def one_row(store: str, ranks: int, log: Path, etcd_log: Path | None) -> dict[str, Any]:
    with registry_server(store, log=log) as url:
        watcher = Watcher(url.pid)
        watcher.start()
        t0 = time.monotonic()
        try:
            row = http_storm(url, ranks)
        except Exception as exc:  # reported with the evidence, then the next row runs
            row = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            watcher.done.set()
            watcher.join()
        row["wall_s"] = round(time.monotonic() - t0, 1)
        row["server_peak"] = watcher.peak
        alive = Path(f"/proc/{url.pid}").exists()
    row["server_alive_at_end"] = alive
    if "failed" in row or row.get("errors"):
        row["registry_log_tail"] = _tail(log)
        if etcd_log is not None:
            row["etcd_log_tail"] = _tail(etcd_log)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.etcd_load", description=__doc__)
    parser.add_argument("--ranks", default="1024,4096", help="comma-separated storm sizes")
    parser.add_argument("--sqlite", action="store_true", help="also run each size on SQLite")
    parser.add_argument("--keep", type=Path, help="keep the logs and data in this directory")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.ranks.split(",") if n.strip()]

    from harness.etcd import EtcdCluster

    with tempfile.TemporaryDirectory(prefix="etcd-load-") as name:
        tmp = args.keep or Path(name)
        with EtcdCluster(tmp / "etcd", size=1) as cluster:
            etcd_log = cluster.members[0].log_path
            for n in sizes:
                rows: list[tuple[str, str, Path | None]] = [
                    ("etcd", cluster.url(f"load-{uuid.uuid4().hex[:8]}"), etcd_log)
                ]
                if args.sqlite:
                    rows.append(("sqlite", f"sqlite:///{tmp}/storm-{n}.db", None))
                for kind, store, elog in rows:
                    say(f"registry on {kind}, {n} ranks")
                    row = one_row(store, n, tmp / f"registry-{kind}-{n}.log", elog)
                    print(json.dumps({"store": kind, "ranks": n, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
