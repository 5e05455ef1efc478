"""``python -m bench.router_round [--instances 12500] [--rounds 15]``: one router-sync round at
fleet size, against a real registry and a real vllm-router.

The instances are published through the registry's API (`harness.serving_fleet`: TP 1
groups, half prefill and half decode, one model, ready, published where they serve). Then, in
this process as ``engine-registry router-sync`` does it: the watch's first list (timed), and
``--rounds`` rounds one second apart after a change, each timed in its two parts: what is
offered (`registry_client.router_sync.offers.offer`) and the sends to the router
(`registry_client.router_sync.vllm_router.announce`);
then ``--rounds`` steady rounds (`Announcer.round` with the groups unchanged: the same list sent
again, not worked out). The router's own view comes from its log: instances it added and
expired. Nothing is asserted; the figures are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import machine, say


def measure(instances: int, rounds: int) -> dict[str, Any]:
    import zmq

    from harness.server import RegistryProcess
    from harness.serving_fleet import publish
    from registry_client.client import RegistryClient
    from registry_client.router_sync.offers import offer
    from registry_client.router_sync.sync import Announcer
    from registry_client.router_sync.vllm_router import VllmRouter, announce
    from workers.tools.routers import VllmRouterProcess

    tmp = Path(tempfile.mkdtemp(prefix="router-round-"))
    out: dict[str, Any] = {"instances": instances}
    with RegistryProcess(f"sqlite:///{tmp / 'r.db'}", log_path=tmp / "registry.log") as registry:
        say(f"publishing {instances} serving groups")
        out["publish_s"] = round(publish(registry.url, instances), 1)
        router = VllmRouterProcess(tmp).start()
        context = zmq.Context()
        target = VllmRouter(router.discovery, context)
        try:
            with RegistryClient(registry.url, timeout_s=60.0) as client:
                t0 = time.perf_counter()
                sync = next(iter(client.watch()))
                out["list_s"] = round(time.perf_counter() - t0, 2)
            engines = sync.groups
            offer_s, send_s, sent = [], [], []
            for _ in range(rounds):
                started = time.perf_counter()
                offered, _ = offer(engines)
                packed = [o.packed() for o in offered]
                offered_at = time.perf_counter()
                announce([target], packed, 1.0)
                done = time.perf_counter()
                offer_s.append(offered_at - started)
                send_s.append(done - offered_at)
                sent.append(target.sent)
                threading.Event().wait(max(0.0, 1.0 - (done - started)))
            # Steady rounds: nothing changed since the last, the same list is sent again.
            announcer = Announcer([target], None, deadline_s=1.0)
            announcer.round(engines, 1)
            steady_s = []
            for _ in range(rounds):
                started = time.perf_counter()
                announcer.round(engines, 1)
                steady_s.append(time.perf_counter() - started)
                threading.Event().wait(max(0.0, 1.0 - steady_s[-1]))
            text = router.log_text()
            out |= {
                "offered": len(offered),
                "offer_s": _spread(offer_s),
                "send_s": _spread(send_s),
                "round_s": _spread([a + b for a, b in zip(offer_s, send_s, strict=True)]),
                "steady_round_s": _spread(steady_s),
                "sent_min": min(sent),
                "router_added": len(re.findall(r"Add (?:Prefill|Decode) \[HTTP:", text)),
                "router_expired": len(re.findall(r"Remove (?:Prefill|Decode) .*expired", text)),
            }
        finally:
            target.close()
            context.term()
            router.stop()
    return out


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 3),
        "median": round(ordered[len(ordered) // 2], 3),
        "max": round(ordered[-1], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--instances", type=int, default=12500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    result = {"machine": machine(), **measure(args.instances, args.rounds)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
