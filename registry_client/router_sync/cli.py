"""The ``router-sync`` subcommand's flags and entry (the loop is
`registry_client.router_sync.sync`)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def add_command(sub: Any, add_tls_flags: Any) -> None:
    from registry_client.cli_flags import DEFAULT_URL

    cmd = sub.add_parser(
        "router-sync",
        help="keep running routers (vllm-router, smg) in step with the registry's instances",
        description="Follows the registry's watch stream and announces every ready prefill "
        "and decode instance that published where it serves to each router's discovery "
        "address (vllm-router; an instance the registry stops offering leaves it within "
        "~5 s) or registers it through its worker API (smg; withdrawn by DELETE at once). "
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
    cmd.add_argument(
        "--smg",
        action="append",
        default=[u.strip() for u in os.environ.get("ROUTER_SYNC_SMG", "").split(",") if u.strip()],
        metavar="URL",
        help="an smg gateway's URL (its worker API: POST/GET/DELETE /workers); repeat for "
        "several (ROUTER_SYNC_SMG: comma-separated URLs, fed besides these)",
    )
    cmd.add_argument(
        "--smg-api-key",
        default=os.environ.get("SMG_API_KEY") or None,
        help="bearer key for smg's worker API: an admin key of its --control-plane-api-keys, "
        "or its --api-key (SMG_API_KEY)",
    )
    cmd.add_argument(
        "--smg-ca",
        default=os.environ.get("SMG_CA") or None,
        help="PEM CA bundle that signed an https:// smg's certificate (SMG_CA; default: the "
        "system trust store)",
    )
    cmd.add_argument(
        "--smg-own",
        action="store_true",
        help="router-sync owns smg's worker list: it also withdraws workers it did not add",
    )
    cmd.add_argument(
        "--smg-drain",
        type=int,
        default=0,
        metavar="SECONDS",
        help="seconds smg keeps a withdrawn worker draining (no new requests, in-flight ones "
        "finish) before it leaves its list (default 0: at once)",
    )
    cmd.add_argument(
        "--model",
        help="offer instances of this served model only (default: the oldest decode instance's)",
    )
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


ROUTER_EXPIRY_S = 5.0  # vllm-router forgets an instance not announced for this long


def _grace_default() -> float:
    from registry_client.router_sync.sync import DEFAULT_GRACE_S

    value = os.environ.get("ROUTER_SYNC_GRACE_S")
    try:
        return float(value) if value else DEFAULT_GRACE_S
    except ValueError:
        return float("nan")  # refused by check_grace, naming the variable


def command(args: argparse.Namespace) -> int:
    from registry_client.cli_flags import client_tls
    from registry_client.client import RegistryClient
    from registry_client.errors import Forbidden, Unauthorized
    from registry_client.router_sync.sync import run

    problems = (
        []
        if args.vllm_router or args.smg
        else ["name at least one router: --vllm-router HOST:PORT or --smg URL"]
    )
    problems += [p for p in [check_interval(args.interval), check_grace(args.grace)] if p]
    problems += [
        f"--smg {url!r} is not http(s)://host:port" for url in args.smg if not _http_url(url)
    ]
    if not 0 <= args.smg_drain <= 3600:
        problems.append(f"--smg-drain {args.smg_drain} must be 0 to 3600 seconds")
    for address in args.vllm_router:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"--vllm-router {address!r} is not HOST:PORT")
    if args.vllm_router and (missing := _missing_extra()):
        problems.append(
            f"--vllm-router needs {missing} (vllm-router's discovery is ZMQ carrying msgpack): "
            "install the router-sync extra from the checkout: .venv/bin/pip install -e "
            "'.[router-sync]' (the package is not on an index)"
        )
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
        smgs = _smgs(args)
    except ValueError as exc:
        print(f"engine-registry router-sync: {exc}", file=sys.stderr)
        return 2
    try:
        return run(
            client,
            args.vllm_router,
            model=args.model,
            interval_s=args.interval,
            stop=stop,
            alive_file=args.alive_file,
            grace_s=args.grace,
            smgs=smgs,
        )
    finally:
        client.close()


def _missing_extra() -> str | None:
    """The ``router-sync`` extra's module that is not installed, if one is not."""
    for module in ("zmq", "msgpack"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def _http_url(url: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _smgs(args: argparse.Namespace) -> list[Any]:
    from registry_client.router_sync.smg import Smg
    from registry_client.tls import ClientTLS

    verify: Any = True
    if args.smg_ca:
        verify = ClientTLS(Path(args.smg_ca), None, None, ca_name="--smg-ca").context
    return [
        Smg(url, api_key=args.smg_api_key, verify=verify, own=args.smg_own, drain_s=args.smg_drain)
        for url in args.smg
    ]


def check_grace(grace_s: float) -> str | None:
    if not 2.0 <= grace_s <= 3600.0:  # NaN too
        return (
            f"--grace {grace_s:g} (or ROUTER_SYNC_GRACE_S) must be a number of seconds from 2 "
            "to 3600, above the registry's bookmark interval (REGISTRY_WATCH_BOOKMARK_S, 5 s)"
        )
    return None


def check_interval(interval_s: float) -> str | None:
    if not 0.05 <= interval_s < ROUTER_EXPIRY_S:
        return (
            f"--interval {interval_s:g} must be from 0.05 to below {ROUTER_EXPIRY_S:g} s "
            "(vllm-router forgets an instance it has not heard of for 5 s)"
        )
    return None
