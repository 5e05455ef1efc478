"""A real vLLM instance's registry requests, by group, node and route, from the registry's
access log: the plugin names its group and node in its ``User-Agent``
(`workers.vllm_plugin.common.user_agent`) and the registry logs it with each request."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

_AGENT = re.compile(r"vllm-plugin \(group (?P<group>[^;]+); node (?P<node>[^;]+); pid")
BATCH_PUT = "PUT /tp-groups/{group_id}/engine/agents"
RANK_PUT = "PUT /tp-groups/{group_id}/engine/agents/{rank}"
BATCH_HEARTBEAT = "POST /tp-groups/{group_id}/engine/agents/heartbeat"
RANK_HEARTBEAT = "POST /tp-groups/{group_id}/engine/agents/{rank}/heartbeat"


@dataclass(frozen=True)
class Request:
    at: float  # when the registry answered (time.time())
    group: str
    node: str
    route: str  # method and route template


def plugin_requests(log_path: Path) -> list[Request]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"user_agent"' not in line or "vllm-plugin" not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        match = _AGENT.search(str(entry.get("user_agent") or ""))
        if match is None or "route" not in entry:
            continue
        at = datetime.fromisoformat(entry["ts"]).timestamp()
        route = f"{entry['method']} {entry['route']}"
        found.append(Request(at, match["group"], match["node"], route))
    return found


def by_node(
    requests: list[Request], group: str, since: float, until: float
) -> dict[str, Counter[str]]:
    """`group`'s requests answered in [since, until), per node, by route."""
    nodes: dict[str, Counter[str]] = {}
    for r in requests:
        if r.group == group and since <= r.at < until:
            nodes.setdefault(r.node, Counter())[r.route] += 1
    return dict(sorted(nodes.items()))


def describe(counts: Counter[str], per_minute: float = 0.0) -> str:
    """``N (route n, ...)``; with `per_minute` > 0 the counts are divided into rates."""
    short = {
        BATCH_PUT: "batch PUT",
        RANK_PUT: "per-rank PUT",
        BATCH_HEARTBEAT: "batch heartbeat",
        RANK_HEARTBEAT: "per-rank heartbeat",
    }
    scale = (lambda n: n / per_minute) if per_minute > 0 else (lambda n: float(n))
    parts = ", ".join(
        f"{short.get(route, route)} {scale(n):.3g}" for route, n in counts.most_common()
    )
    return f"{scale(sum(counts.values())):.3g} ({parts})"


def keepalive_renewals(url: str) -> int:
    """Renewals the registry answered over keep-alive streams (``GET /keepalive``: its access
    log has the upgrade, not the renewals; ``registry_keepalive_renewals_total{outcome=
    "renewed"}``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'^registry_keepalive_renewals_total\{outcome="renewed"\} (\S+)$', text, re.M)
    return int(float(found[1])) if found else 0


def report_and_check(
    log_path: Path,
    launches: dict[str, tuple[float, float, int]],
    until: dict[str, float],
    out: dict[str, str],
    streamed: int = 0,
) -> None:
    """Each group's requests per node at launch (start until healthy) and per minute after
    (until `until[group]`), into `out` (the tier's summary); every node registered its ranks
    with one batch request and renews them over its keep-alive stream or with batch heartbeats,
    never per rank (the plugin's default,
    ``ENGINE_REGISTRY_PUBLISH=node``). `launches`: group -> (started, healthy, nodes)."""
    requests = plugin_requests(log_path)
    for group, (started, healthy, nodes) in launches.items():
        launch = by_node(requests, group, started, healthy)
        after = by_node(requests, group, healthy, until[group])
        window = until[group] - healthy
        for node, counts in launch.items():
            out[f"{group}, node {node}: at launch"] = describe(counts)
        for node, counts in after.items():
            out[f"{group}, node {node}: a minute after"] = (
                f"{describe(counts, window / 60)} over {window:.0f} s"
            )
        assert len(launch) == nodes, (group, launch)
        for node, counts in launch.items():
            assert counts[BATCH_PUT] == 1, (group, node, counts)
            assert counts[RANK_PUT] == 0, (group, node, counts)
        for node, counts in after.items():
            assert counts[RANK_HEARTBEAT] == 0, (group, node, counts)
            # a node renews over its keep-alive stream (``streamed``: every node's), or with
            # batch heartbeats where the registry refuses the stream
            assert counts[BATCH_HEARTBEAT] > 0 or streamed > 0, (group, node, counts)
