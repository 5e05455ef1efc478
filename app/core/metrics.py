"""Prometheus metrics, one registry per app instance (tests build many apps in one process)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The process's CPU, memory and descriptors, and the garbage collector's work per
        # generation (process_*, python_gc_*: what an operator checks first under load).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.requests = self._counter(
            "registry_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
        )
        self.latency = self._histogram(
            "registry_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
        )
        self.engines_opened = self._counter(
            "registry_engines_opened", "Engines (generations) opened."
        )
        self.mismatches = self._counter(
            "registry_engine_id_mismatches",
            "engine_id_mismatch answers, by cause (superseded, other_group, unknown).",
            ["cause"],
        )
        self.live_agents = self._gauge(
            "registry_live_agents", "Agents with an unexpired lease, at the last scrape."
        )
        self.groups = self._gauge("registry_groups", "Groups known, at the last scrape.")
        self.ready_groups = self._gauge(
            "registry_ready_groups",
            "Groups whose current engine has a live agent on every rank, at the last scrape.",
        )
        self.store_up = self._gauge(
            "registry_store_up", "1 when the store answered the last check, else 0."
        )

        self.store_unavailable = self._counter(
            "registry_store_unavailable",
            "Answers 503 store_unavailable: the store did not answer within --store-timeout.",
        )
        self.lease_expiries = self._counter(
            "registry_lease_expiries",
            "Agents whose lease expired, as this replica observed between two reads of every "
            "group (scrapes, status pages): aggregate replicas with max, not sum.",
        )
        self.longest_not_ready = self._gauge(
            "registry_longest_not_ready_seconds",
            "How long the group that has been not ready longest has been so (0: all ready), "
            "at the last scrape.",
        )
        self.events_dropped = self._counter(
            "registry_events_dropped",
            "Events left out because the buffer was full before a flush (REGISTRY_EVENTS_KEEP).",
        )
        self._streams_and_load()

    def _streams_and_load(self) -> None:
        """Watch and keep-alive streams, shedding, and where group reads are answered."""
        self.watchers = self._gauge("registry_watchers", "Watch streams open on this replica.")
        self.watch_events_sent = self._counter(
            "registry_watch_events_sent",
            "Changes (ADDED, MODIFIED, DELETED lines) written to watch streams.",
        )
        self.watch_slow_consumers = self._counter(
            "registry_watch_slow_consumers_closed",
            "Watch streams closed because their consumer fell behind its send budget.",
        )

        self.shed = self._counter(
            "registry_shed_requests",
            "Requests answered 503 overloaded with Retry-After while the registry was "
            "saturated (REGISTRY_SHED_*), by path.",
            ["route"],
        )

        self.keepalive_renewals = self._counter(
            "registry_keepalive_renewals",
            "Renewals answered over keep-alive streams (GET /keepalive), by outcome: renewed, "
            "or the problem code.",
            ["outcome"],
        )
        self.group_reads = self._counter(
            "registry_group_reads",
            "Groups read for handshakes, resolutions and engine reads, by where the answer "
            "came from: the watch feed (etcd, once current) or the store's reads.",
            ["source"],
        )
        self.feed_reads = self.group_reads.labels("feed")
        self.store_reads = self.group_reads.labels("store")

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
