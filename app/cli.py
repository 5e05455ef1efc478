"""``engine-registry``: serve the registry, show a running one's groups, run the demo."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
from pydantic import ValidationError

DEFAULT_URL = "http://127.0.0.1:8080"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app import logs
    from app.auth import TokenFileError
    from app.main import create_app
    from app.settings import Settings

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "store": args.store,
            "tokens_file": args.tokens_file,
            "store_timeout_s": args.store_timeout,
            "log_level": args.log_level,
        }.items()
        if v is not None
    }
    if args.insecure:
        overrides["insecure"] = True
    try:
        # Its validator reads the tokens, so a bad tokens file fails here, once.
        settings = Settings(**overrides)
    except (ValidationError, TokenFileError) as exc:
        print(f"engine-registry: cannot start: {_first_error(exc)}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"engine-registry: cannot start: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        # Idle connections stay open 75 s, not uvicorn's 5 s: clients keep idle connections
        # pooled longer (aiohttp 15 s; httpx 5 s, the same instant), and a request sent on a
        # connection the server closes at that moment is reset (ECONNRESET). A slow store
        # leaves a storm's connections idle past 5 s: that reset the 4,096-rank storm on etcd.
        timeout_keep_alive=75,
    )
    return 0


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg
    return str(exc)


def _age(expires_at: str | None) -> str:
    if not expires_at:
        return "-"
    ts = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()
    return f"{ts - time.time():.0f}s"


def format_groups(groups: list[dict[str, Any]]) -> str:
    """The groups as a table: group, role, generation, engine_id, ready ranks, oldest lease."""
    header = ("GROUP", "ROLE", "GEN", "ENGINE_ID", "READY", "LEASE_LEFT", "MISSING")
    rows = [header]
    for g in sorted(groups, key=lambda g: str(g["group_id"])):
        agents = g.get("agents") or []
        oldest = min((a["expires_at"] for a in agents), default=None)
        missing = g.get("missing_ranks") or []
        rows.append(
            (
                str(g["group_id"]),
                str(g["role"]),
                str(g["generation"]),
                str(g["engine_id"]),
                f"{len(g['registered_ranks'])}/{g['tp_size']}" + (" ready" if g["ready"] else ""),
                _age(oldest),
                ",".join(map(str, missing[:8])) + ("…" if len(missing) > 8 else "") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _status(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("REGISTRY_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(
            f"{args.url.rstrip('/')}/tp-groups", headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as exc:
        print(f"engine-registry: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if answer.status_code != 200:
        try:
            detail = answer.json().get("detail", answer.text)
        except ValueError:
            detail = answer.text
        print(
            f"engine-registry: {args.url} answered {answer.status_code}: {detail}", file=sys.stderr
        )
        return 1
    groups = answer.json()["groups"]
    print(format_groups(groups) if groups else "no groups")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-registry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the registry service")
    serve.add_argument("--host", help="listen address (REGISTRY_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (REGISTRY_PORT, default 8080)")
    serve.add_argument(
        "--store", help="sqlite:///path.db or etcd://h:p[,h:p]/prefix (REGISTRY_STORE)"
    )
    serve.add_argument("--tokens-file", help="role:token lines (REGISTRY_TOKENS_FILE)")
    serve.add_argument(
        "--insecure", action="store_true", help="allow no tokens off loopback (REGISTRY_INSECURE)"
    )
    serve.add_argument(
        "--store-timeout", type=float, help="seconds before a store call answers 503"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)

    status = sub.add_parser("status", help="show a running registry's groups as a table")
    status.add_argument("--url", default=os.environ.get("REGISTRY_URL", DEFAULT_URL))
    status.add_argument("--token", help="bearer token (or REGISTRY_TOKEN)")
    status.add_argument("--timeout", type=float, default=10.0)
    status.set_defaults(func=_status)

    demo = sub.add_parser(
        "demo",
        help="prefill/decode demo on this machine (needs the workers extra)",
        add_help=False,
    )
    demo.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        try:
            from workers.demo import main as demo_main  # needs torch and nixl
        except ImportError as exc:
            print(
                f"engine-registry demo needs the workers extra "
                f"(pip install 'engine-registry[workers]'): {exc}",
                file=sys.stderr,
            )
            return 2
        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
