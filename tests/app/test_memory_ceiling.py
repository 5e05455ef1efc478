"""One writer cannot grow the registry's memory without bound: a group at the largest TP size
the registry takes, every rank registered one request at a time with its agent name and host
at their length limits, each registration a change whose watch line carries the whole group,
and a watcher attached that reads every line and relists as router-sync does. The watch
history is bounded by its events' weight (``REGISTRY_WATCH_HISTORY_BYTES``): the registry's
RSS grows by a bounded amount, where without the bound it kept every line (a hostile run
reached 2.8 GiB at TP 4,096)."""

from __future__ import annotations

import base64
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from app.core.schemas import MAX_AGENT_NAME, MAX_HOST, MAX_TP_SIZE
from harness.server import RegistryProcess
from registry_client.client import RegistryClient
from registry_client.errors import RegistryUnavailable

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

HISTORY_BYTES = 16 * 1024 * 1024
TP = min(MAX_TP_SIZE, 1024)
KV = {"mem_type": "DRAM", "device_id": 0, "base_addrs": [4096], "num_blocks": 8, "block_len": 4096}
GROWTH_LIMIT_MIB = 160


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def host_at_limit(rank: int) -> str:
    """A DNS name of ``MAX_HOST`` characters (labels of 63), unique per rank."""
    head = f"r{rank:05d}"
    labels = [head + "a" * (63 - len(head))]
    while sum(len(x) + 1 for x in labels) + 63 <= MAX_HOST:
        labels.append("b" * 63)
    rest = MAX_HOST - sum(len(x) + 1 for x in labels)
    labels.append("c" * rest)
    name = ".".join(labels)
    assert len(name) == MAX_HOST, len(name)
    return name


def test_a_writer_registering_a_largest_group_leaves_the_registry_memory_bounded(
    tmp_path: Path,
) -> None:
    args = ["--watch-history-bytes", str(HISTORY_BYTES), "--no-access-log", "--log-level"]
    args += ["warning", "--watch-bookmark-s", "1"]
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    with (
        RegistryProcess(url, args=args, log_path=tmp_path / "registry.log") as proc,
        httpx.Client(base_url=proc.url, timeout=30) as c,
        RegistryClient(proc.url, timeout_s=30) as reader,
    ):
        group = f"big-{uuid.uuid4().hex[:6]}"
        body = {"launch_id": "l-1", "tp_size": TP, "role": "prefill"}
        engine = c.put(f"/tp-groups/{group}/engine", json=body).json()
        seen: list[int] = []
        stop = threading.Event()

        def follow() -> None:
            try:
                for event in reader.watch(idle_timeout_s=20, lost_after_s=60):
                    # A watcher behind the bounded history relists: the SYNC carries the group.
                    engines = [event.engine] if event.engine is not None else event.groups
                    seen.extend(len(e.registered_ranks) for e in engines if e.group_id == group)
                    if stop.is_set():
                        return
            except (RegistryUnavailable, httpx.HTTPError, RuntimeError):
                return  # the client closed under it at the end

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        time.sleep(1.0)
        start = rss_mib(proc.pid)
        blob = base64.b64encode(b"m" * 64).decode()
        for rank in range(TP):
            agent = {
                "engine_id": engine["engine_id"],
                "agent_name": f"{rank:05d}" + "n" * (MAX_AGENT_NAME - 5),
                "agent_metadata": blob,
                "host": host_at_limit(rank),
                "kv": KV,
                "ttl_s": 300,
            }
            resp = c.put(f"/tp-groups/{group}/engine/agents/{rank}", json=agent)
            assert resp.status_code == 201, resp.text
        deadline = time.monotonic() + 60
        while not seen or seen[-1] < TP:
            assert time.monotonic() < deadline, f"the watcher saw {seen[-1:]} agents at most"
            time.sleep(0.2)
        grown = rss_mib(proc.pid) - start
        stop.set()
    # Every line the watcher read carried the group (up to MAX_TP_SIZE agents): without the
    # bound the history kept them all.
    assert grown < GROWTH_LIMIT_MIB, f"RSS grew {grown:.0f} MiB"
