"""Run under torchrun by `test_node_publish.py`: the plugin's per-node publication
(`workers.vllm_plugin.node_publish`) over a real gloo group, without vLLM.

``python -m tests.workers.vllm_plugin.node_publish_main URL GROUP REPORT_DIR SERVE_S [FAIL_RANK]``:
every rank agrees on the engine with the registry (`sync_engine_id`), describes a stand-in
agent (named so: no NIXL here; the plugin's own description needs vLLM's connector), publishes
by node, serves ``SERVE_S`` seconds and closes; ``FAIL_RANK`` cannot describe its agent. Each
rank writes ``REPORT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from registry_client.client import RegistryClient
from registry_client.errors import EngineIdentityError
from registry_client.models import AgentItem, KvSpec
from workers.identity import sync_engine_id
from workers.vllm_plugin.node_publish import publish_by_node


def main(url: str, group_id: str, report_dir: Path, serve_s: float, fail_rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = f"host/{os.environ['GROUP_RANK']}"
    report: dict[str, Any] = {"rank": rank, "node": node}

    def make_client() -> RegistryClient:
        return RegistryClient(url, timeout_s=15)

    with make_client() as client:
        identity = sync_engine_id(client, group_id, tp_size=world, role="prefill", timeout_s=15)

    def describe() -> AgentItem:
        if rank == fail_rank:
            raise ValueError(f"rank {rank} has no KV caches (the test's failure)")
        kv = KvSpec("DRAM", 0, [1 << 20], 4, 512, 4)
        name = f"stand-in-agent-{rank}"
        return AgentItem(rank, identity.engine_id, name, name.encode(), "127.0.0.1", kv)

    try:
        share = publish_by_node(
            make_client,
            identity,
            describe,
            rank=rank,
            node=node,
            group=None,
            ttl_s=5,
            logger=logging.getLogger("node_publish"),
        )
    except EngineIdentityError as exc:
        report |= {"status": "refused", "error": str(exc), "causes": exc.causes}
        (report_dir / f"rank{rank}.json").write_text(json.dumps(report))
        return 3
    report |= {"status": "ok", "leader": share.leader, "ranks": share.ranks}
    time.sleep(serve_s)
    dist.barrier()  # every rank served its time before the leaders deregister
    share.close()
    if share.batch is not None:
        report["heartbeats"] = share.batch.heartbeats
    (report_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    url, group_id, report_dir, serve_s = sys.argv[1:5]
    fail = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    sys.exit(main(url, group_id, Path(report_dir), float(serve_s), fail))
