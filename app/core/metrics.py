"""Prometheus metrics, one registry per app instance (tests build many apps in one process)."""

from __future__ import annotations

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The process's CPU, memory and descriptors, and the garbage collector's work per
        # generation (process_*, python_gc_*: what an operator checks first under load).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.requests = Counter(
            "registry_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "registry_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template and method.",
            ["route", "method"],
            buckets=(
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
            ),
            registry=self.registry,
        )
        self.engines_opened = Counter(
            "registry_engines_opened",
            "Engines (generations) opened.",
            registry=self.registry,
        )
        self.mismatches = Counter(
            "registry_engine_id_mismatches",
            "engine_id_mismatch answers, by cause (superseded, other_group, unknown).",
            ["cause"],
            registry=self.registry,
        )
        self.live_agents = Gauge(
            "registry_live_agents",
            "Agents with an unexpired lease, at the last scrape.",
            registry=self.registry,
        )
        self.groups = Gauge(
            "registry_groups", "Groups known, at the last scrape.", registry=self.registry
        )
        self.ready_groups = Gauge(
            "registry_ready_groups",
            "Groups whose current engine has a live agent on every rank, at the last scrape.",
            registry=self.registry,
        )
        self.store_up = Gauge(
            "registry_store_up",
            "1 when the store answered the last check, else 0.",
            registry=self.registry,
        )

        self.store_unavailable = Counter(
            "registry_store_unavailable",
            "Answers 503 store_unavailable: the store did not answer within --store-timeout.",
            registry=self.registry,
        )
        self.lease_expiries = Counter(
            "registry_lease_expiries",
            "Agents whose lease expired, as this replica observed between two reads of every "
            "group (scrapes, status pages): aggregate replicas with max, not sum.",
            registry=self.registry,
        )
        self.longest_not_ready = Gauge(
            "registry_longest_not_ready_seconds",
            "How long the group that has been not ready longest has been so (0: all ready), "
            "at the last scrape.",
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "registry_events_dropped",
            "Events left out because the buffer was full before a flush (REGISTRY_EVENTS_KEEP).",
            registry=self.registry,
        )

        self.watchers = Gauge(
            "registry_watchers", "Watch streams open on this replica.", registry=self.registry
        )
        self.watch_events_sent = Counter(
            "registry_watch_events_sent",
            "Changes (ADDED, MODIFIED, DELETED lines) written to watch streams.",
            registry=self.registry,
        )
        self.watch_slow_consumers = Counter(
            "registry_watch_slow_consumers_closed",
            "Watch streams closed because their consumer fell behind its send budget.",
            registry=self.registry,
        )

        self.shed = Counter(
            "registry_shed_requests",
            "Requests answered 503 overloaded with Retry-After while the registry was "
            "saturated (REGISTRY_SHED_*), by path.",
            ["route"],
            registry=self.registry,
        )

        self.keepalive_renewals = Counter(
            "registry_keepalive_renewals",
            "Renewals answered over keep-alive streams (GET /keepalive), by outcome: renewed, "
            "or the problem code.",
            ["outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
