"""`engine-registry router-sync` at fleet size: 2,500 ready instances published through a real
registry's API (harness/serving_fleet.py), a real router-sync process feeding a real
vllm-router (0.1.17). vllm-router's discovery takes one message per instance and forgets one it
has not heard of for 5 s; with non-blocking sends into ZMQ's 1,000-message queue the rest of
each round was dropped and the router saw instances flap (2,000 adds and 500 expiries in 20 s
here). Every instance is sent each round: the router's own view (its log of the instances it
adds and expires) holds steady."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from harness.server import RegistryProcess
from harness.serving_fleet import publish
from tests.app.api.test_router_sync import wait_for
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess

pytestmark = [pytest.mark.api, pytest.mark.timeout(400)]
INSTANCES = 2500
WINDOW_S = 15.0  # three of the router's expiries


def seen(router: VllmRouterProcess) -> tuple[int, int]:
    """(instances the router added, instances it expired), from its own log."""
    text = router.log_text()
    adds = len(re.findall(r"Add (?:Prefill|Decode) \[HTTP:", text))
    return adds, len(re.findall(r"Remove (?:Prefill|Decode) \[HTTP:[^\]]*expired\]", text))


def test_every_instance_reaches_the_router_each_round_and_none_flaps(tmp_path: Path) -> None:
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}", log_path=tmp_path / "registry.log"
    ) as registry:
        took = publish(registry.url, INSTANCES)
        print(f"published {INSTANCES} serving groups in {took:.0f} s")
        router = VllmRouterProcess(tmp_path).start()
        sync = RouterSyncProcess(tmp_path, registry.url, [router.discovery], interval_s=1.0)
        try:
            sync.start()
            wait_for(lambda: seen(router)[0] >= INSTANCES, 90, "the router has every instance")
            before = seen(router)
            assert before == (INSTANCES, 0), before
            time.sleep(WINDOW_S)
            after = seen(router)
            assert after == before, (
                f"the router's view flapped in {WINDOW_S:g} s: {after[0] - before[0]} adds, "
                f"{after[1] - before[1]} expiries"
            )
            assert "instances within the round's" not in sync.log_text()
        finally:
            sync.stop()
            router.stop()
