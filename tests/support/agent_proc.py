"""A stand-in for one TP rank's registry client, run as its own process by the fault tests:
it registers its agent, then heartbeats until it is killed (or, as a safety net, until
``--max-life-s`` passes).

    python -m tests.support.agent_proc URL GROUP RANK ENGINE_ID [--ttl-s 5]
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from tests.support.faults import agent_body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("group")
    parser.add_argument("rank", type=int)
    parser.add_argument("engine_id")
    parser.add_argument("--ttl-s", type=int, default=5)
    parser.add_argument("--max-life-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    path = f"/tp-groups/{args.group}/engine/agents/{args.rank}"
    body = agent_body(args.engine_id, args.rank, args.ttl_s)
    born = time.monotonic()
    with httpx.Client(base_url=args.url, timeout=10.0) as http:
        registered = False
        while time.monotonic() - born < args.max_life_s:
            try:
                if not registered:
                    answer = http.put(path, json=body)
                    registered = answer.status_code in (200, 201)
                    if registered:
                        print("registered", flush=True)
                else:
                    answer = http.post(f"{path}/heartbeat", json={"engine_id": args.engine_id})
                    if answer.status_code == 404:
                        registered = False  # the lease expired: register again
                        continue
                    if answer.status_code == 409:
                        print(f"superseded: {answer.text}", flush=True)
                        return 3
            except httpx.HTTPError as exc:
                print(f"registry unreachable: {exc}", flush=True)
            time.sleep(args.ttl_s / 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
