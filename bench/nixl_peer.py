"""The remote side of the NIXL benchmarks, in its own process (``python -m bench.nixl_peer``).

- ``prefill URL GROUP TP``: one NIXL agent per rank (UCX, 1 MiB of registered DRAM each),
  opens the group's engine on the registry and registers every agent with its real metadata.
- ``target BYTES``: one agent holding BYTES of registered DRAM filled with a pattern.

Either prints one JSON line on stdout when ready, then serves until stdin closes (bounded by
``LIFETIME_S``), so the parent's exit always ends it.
"""

from __future__ import annotations

import base64
import json
import os
import select
import sys
import time
import uuid
from typing import Any

LIFETIME_S = 900.0
READY = "BENCH-READY "


def _agent(name: str, progress_thread: bool = True) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    from workers import nixl_progress

    nixl_progress.apply()  # ENGINE_REGISTRY_NIXL_PROGRESS_US, as every agent of the project

    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    return nixl_agent(name, config)


def _ready(info: dict[str, Any]) -> None:
    # NIXL's own log lines share stdout, so the ready line carries a marker.
    print(READY + json.dumps(info), flush=True)


def _serve_until_stdin_closes() -> None:
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return


def prefill(url: str, group: str, tp: int) -> None:
    import httpx
    import torch

    with httpx.Client(base_url=url, timeout=30) as http:
        answer = http.put(
            f"/tp-groups/{group}/engine",
            json={"launch_id": uuid.uuid4().hex, "tp_size": tp, "role": "prefill"},
        )
        answer.raise_for_status()
        engine_id = answer.json()["engine_id"]
        keep = []
        for rank in range(tp):
            name = f"{engine_id}-rank{rank}"
            # No progress threads: these agents only publish metadata here, and eight idle
            # UCX progress threads take half a core from the registry on a 2-core machine
            # (on real deployments the prefill ranks live on other hosts).
            agent = _agent(name, progress_thread=False)
            memory = torch.zeros(1 << 20, dtype=torch.uint8)
            agent.register_memory(memory)
            metadata = bytes(agent.get_agent_metadata())
            body = {
                "engine_id": engine_id,
                "agent_name": name,
                "agent_metadata": base64.b64encode(metadata).decode(),
                "host": "127.0.0.1",
                "kv": {
                    "mem_type": "DRAM",
                    "device_id": 0,
                    "base_addrs": [memory.data_ptr()],
                    "num_blocks": 16,
                    "block_len": 65536,
                },
                "ttl_s": 3600,
            }
            http.put(f"/tp-groups/{group}/engine/agents/{rank}", json=body).raise_for_status()
            keep.append((agent, memory, len(metadata)))
        _ready({"engine_id": engine_id, "metadata_bytes": [k[2] for k in keep]})
        _serve_until_stdin_closes()


def target(size: int) -> None:
    import torch

    name = f"target-{uuid.uuid4().hex[:8]}"
    agent = _agent(name)
    memory = (torch.arange(size, dtype=torch.int64) % 251).to(torch.uint8)
    agent.register_memory(memory)
    _ready(
        {
            "name": name,
            "pid": os.getpid(),
            "addr": memory.data_ptr(),
            "size": size,
            "metadata": base64.b64encode(bytes(agent.get_agent_metadata())).decode(),
        }
    )
    _serve_until_stdin_closes()


def main(argv: list[str]) -> int:
    if argv[0] == "prefill":
        prefill(argv[1], argv[2], int(argv[3]))
    elif argv[0] == "target":
        target(int(argv[1]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
