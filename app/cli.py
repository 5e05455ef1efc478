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


# Flags kept from before the flags were derived from the settings' fields.
_FLAG_ALIASES = {"store_timeout_s": ["--store-timeout"]}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`app.settings.Settings`; values are validated there."""
    from app.settings import Settings

    for name, field in Settings.model_fields.items():
        flags = [f"--{name.replace('_', '-')}", *_FLAG_ALIASES.get(name, [])]
        env = f"REGISTRY_{name.upper()}"
        default = "none" if field.default is None else field.default
        text = f"{field.description or ''} ({env}, default {default})".strip()
        if field.annotation is bool:
            parser.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(*flags, dest=name, default=None, metavar="V", help=text)


def _serve(args: argparse.Namespace) -> int:
    from app import logs
    from app.auth import TokenFileError
    from app.main import create_app
    from app.server import serve
    from app.settings import Settings

    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
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
    serve(app, settings)
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
    add_settings_flags(serve)
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
