"""The plugin's counters on the instance's own ``/metrics`` (vLLM's API server).

A decode worker counts what it does on the registry's word (handshakes through the registry or
the side channel, remote engines released and why, remote engines held), but vLLM serves
``/metrics`` from its API server, another process. So each worker writes its counters to a
small JSON file in a directory the launch's first process made (``ENGINE_REGISTRY_METRICS_DIR``,
inherited by every process of the node), and the API server registers a Prometheus collector
that sums those files at each scrape. Workers of other nodes (a multi-node decode) count on
their own node only.

Series: ``engine_registry_handshakes_total{path}`` (registry, side_channel),
``engine_registry_remote_engines_released_total{cause}`` (superseded, deleted, not_ready:
handed to vLLM's release), ``engine_registry_remote_engines_freed_total`` (vLLM freed their
NIXL state), ``engine_registry_remote_engines`` (prefill engines whose NIXL state the decode
workers hold).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_DIR = "ENGINE_REGISTRY_METRICS_DIR"


@dataclass
class Counts:
    handshakes: dict[str, int] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)
    freed: int = 0
    held: int = 0

    def add(self, other: Counts) -> None:
        for mine, theirs in ((self.handshakes, other.handshakes), (self.released, other.released)):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value
        self.freed += other.freed
        self.held += other.held


class WorkerCounters:
    """One worker's counts, saved to its file after each change (atomic replace)."""

    def __init__(self, directory: str | None = None) -> None:
        base = directory if directory is not None else os.environ.get(ENV_DIR)
        self.path = None if not base else Path(base) / f"worker-{os.getpid()}.json"
        self.counts = Counts()
        self._lock = threading.Lock()

    def handshake(self, path: str, held: int) -> None:
        with self._lock:
            self.counts.handshakes[path] = self.counts.handshakes.get(path, 0) + 1
            self.counts.held = held
            self._save()

    def released(self, cause: str) -> None:
        with self._lock:
            self.counts.released[cause] = self.counts.released.get(cause, 0) + 1
            self._save()

    def freed(self, held: int) -> None:
        with self._lock:
            self.counts.freed += 1
            self.counts.held = held
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(asdict(self.counts)))
            os.replace(tmp, self.path)
        except OSError:
            pass  # the directory went away with its launch: nothing to count into


def totals(directory: Path) -> Counts:
    """Every worker's counts in ``directory``, summed (unreadable files skipped)."""
    total = Counts()
    for path in sorted(directory.glob("worker-*.json")):
        try:
            data = json.loads(path.read_text())
            total.add(Counts(**data))
        except (OSError, ValueError, TypeError):
            continue
    return total


class Collector:
    """A Prometheus collector of `totals` (registered in the API server)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counts = totals(self.directory)
        handshakes = CounterMetricFamily(
            "engine_registry_handshakes",
            "NIXL handshakes of decode workers, by path (registry, side_channel)",
            labels=["path"],
        )
        for path in ("registry", "side_channel"):
            handshakes.add_metric([path], counts.handshakes.get(path, 0))
        yield handshakes
        released = CounterMetricFamily(
            "engine_registry_remote_engines_released",
            "prefill engines handed to vLLM's release on the registry's word, by cause",
            labels=["cause"],
        )
        for cause in ("superseded", "deleted", "not_ready"):
            released.add_metric([cause], counts.released.get(cause, 0))
        yield released
        yield CounterMetricFamily(
            "engine_registry_remote_engines_freed",
            "prefill engines whose NIXL state vLLM freed after the registry's word",
            value=counts.freed,
        )
        yield GaugeMetricFamily(
            "engine_registry_remote_engines",
            "prefill engines whose NIXL state this instance's decode workers hold",
            value=counts.held,
        )


def serve_from_first_process() -> Path | None:
    """Make the counters' directory for this launch and register the collector with
    prometheus_client's default registry (vLLM's ``/metrics`` with one API server)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    directory = Path(tempfile.mkdtemp(prefix="engine-registry-metrics-"))
    os.environ[ENV_DIR] = str(directory)
    REGISTRY.register(Collector(directory))
    import atexit

    atexit.register(shutil.rmtree, directory, True)
    return directory
