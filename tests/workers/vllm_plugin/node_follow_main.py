"""A decode worker stand-in for test_node_follow.py: the plugin's own `release.Follower` on
its node's shared watch, following one prefill group. Like vLLM, it handshakes again with the
group's next ready engine after each release. vLLM's state is a stand-in: the release
callable answers "not stored yet" to the first ``fail_first`` tries of each engine (the retry
loop's case). One line on stdout for each thing it does (the test reads them).

    python -m tests.workers.vllm_plugin.node_follow_main URL GROUP NODE DIR MODEL PREFILL N
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from registry_client.client import RegistryClient
from registry_client.models import Handshake
from workers.vllm_plugin import release
from workers.vllm_plugin.settings import PluginSettings

HANDSHAKE_WITHIN_S = 30.0


def main() -> None:
    url, group, node, directory, model, prefill, fail_first = sys.argv[1:8]
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    client = RegistryClient(url, timeout_s=10.0)
    tries: Counter[str] = Counter()
    followed: set[str] = set()

    def release_state(vllm_engine_id: str) -> bool:
        tries[vllm_engine_id] += 1
        return tries[vllm_engine_id] > int(fail_first)

    def handshake() -> None:
        """The group's next ready engine, once: what vLLM does for the next request."""
        deadline = time.monotonic() + HANDSHAKE_WITHIN_S
        while time.monotonic() < deadline:
            engine = client.get_engine(prefill)
            if engine.ready and engine.engine_id not in followed:
                followed.add(engine.engine_id)
                planned = Handshake(engine.engine_id, prefill, engine.generation, 1, 1, [])
                follower.follow(engine.engine_id, planned)
                print(f"FOLLOW {engine.engine_id} {engine.generation}", flush=True)
                return
            time.sleep(0.1)
        print(f"NO-HANDSHAKE within {HANDSHAKE_WITHIN_S} s", flush=True)

    def on_release(done: release.Followed, kind: str, _why: str) -> None:
        print(f"RELEASED {done.engine_id} {kind} tries={tries[done.engine_id]}", flush=True)
        threading.Thread(target=handshake, daemon=True).start()

    settings = PluginSettings(url=url, group=group)
    follower = release.Follower(
        settings, release_state, on_release, model=model, node=node, directory=Path(directory)
    )
    handshake()
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
