"""The ``router-sync`` subcommand's flags and entry (the loop is `app.router_sync`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def add_command(sub: Any, add_tls_flags: Any) -> None:
    from app.cli import DEFAULT_URL

    cmd = sub.add_parser(
        "router-sync",
        help="keep running routers (vllm-router) in step with the registry's instances",
        description="Follows the registry's watch stream and announces every ready prefill "
        "and decode instance that published where it serves to each router's discovery "
        "address; an instance the registry stops offering leaves the router within ~5 s. "
        "Exit codes: 0 stopped (SIGTERM, SIGINT); 2 usage, or the token was refused.",
    )
    cmd.add_argument(
        "--url",
        default=os.environ.get("REGISTRY_URL") or DEFAULT_URL,
        help="registry URL(s), comma-separated replicas (REGISTRY_URL)",
    )
    cmd.add_argument("--token", help="a bearer token with the reader role (or REGISTRY_TOKEN)")
    cmd.add_argument(
        "--vllm-router",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a vllm-router's --vllm-discovery-address; repeat for several routers",
    )
    cmd.add_argument("--model", help="offer instances of this served model only "
                     "(default: the oldest decode instance's)")  # fmt: skip
    cmd.add_argument(
        "--interval", type=float, default=1.0, help="seconds between announcements (< 5)"
    )
    cmd.add_argument(
        "--alive-file",
        type=Path,
        help="touch this file after each round once synced, while not blind past --grace "
        "(a liveness/readiness probe reads its age)",
    )
    cmd.add_argument(
        "--grace",
        type=float,
        default=_grace_default(),
        help="seconds the watch may be blind (no registry heard, or the token refused) before "
        "nothing is offered and --alive-file is no longer touched; keep it above the "
        "registry's bookmark interval (ROUTER_SYNC_GRACE_S, default 30)",
    )
    add_tls_flags(cmd)
    cmd.set_defaults(func=command)


def _grace_default() -> float:
    from app.router_sync import DEFAULT_GRACE_S

    value = os.environ.get("ROUTER_SYNC_GRACE_S")
    try:
        return float(value) if value else DEFAULT_GRACE_S
    except ValueError:
        return float("nan")  # refused by check_grace, naming the variable


def command(args: argparse.Namespace) -> int:
    from app.cli import client_tls
    from app.router_sync import check_grace, check_interval, run
    from workers.client import RegistryClient
    from workers.errors import Forbidden, Unauthorized

    problems = [] if args.vllm_router else ["name at least one router: --vllm-router HOST:PORT"]
    problems += [p for p in [check_interval(args.interval), check_grace(args.grace)] if p]
    for address in args.vllm_router:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"--vllm-router {address!r} is not HOST:PORT")
    if problems:
        print("engine-registry router-sync: " + "; ".join(problems), file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr, force=True
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    token = args.token or os.environ.get("REGISTRY_TOKEN") or None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    client = RegistryClient(args.url, token=token, tls=client_tls(args), timeout_s=10.0)
    try:
        # A token the registry refuses stops here, at once, naming the fix.
        client.request("GET", "/tp-groups", params={"limit": 1})
    except (Unauthorized, Forbidden) as exc:
        print(
            f"engine-registry router-sync: the registry refused the token ({exc}); pass "
            "--token (or REGISTRY_TOKEN) with the reader role",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # unreachable now: follow anyway, it retries
        logging.getLogger("engine_registry.router_sync").warning(
            "router-sync: registry not answering yet (%s); retrying", exc
        )
    try:
        return run(
            client, args.vllm_router, model=args.model, interval_s=args.interval, stop=stop,
            alive_file=args.alive_file, grace_s=args.grace,
        )  # fmt: skip
    finally:
        client.close()
