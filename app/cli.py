"""``engine-registry``: serve the registry, show a running one's groups, run the demo."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
from pydantic import ValidationError

from registry_client import settings_flags
from registry_client.cli_flags import DEFAULT_URL, add_tls_flags, client_tls, unreachable

# Flags kept from before the flags were derived from the settings' fields (after their own).
_FLAG_ALIASES = {"store_timeout_s": ["--store-timeout-s", "--store-timeout"]}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`app.server.settings.Settings`; values are validated there."""
    from app.server.settings import Settings

    settings_flags.add_flags(parser, Settings, _FLAG_ALIASES, env_shown="{}")


def _serve(args: argparse.Namespace) -> int:
    from app.core import logs
    from app.main import create_app
    from app.security.auth import TokenFileError
    from app.server.serve import serve, server_tls
    from app.server.settings import Settings

    try:
        # Its validator reads the tokens, so a bad tokens file fails here, once.
        settings = Settings(**settings_flags.given(args, Settings))
    except (ValidationError, TokenFileError) as exc:
        print(f"engine-registry: cannot start: {_first_error(exc)}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    try:
        tls = server_tls(settings)
        app = create_app(settings)
    except ValueError as exc:
        print(f"engine-registry: cannot start: {exc}", file=sys.stderr)
        return 2
    serve(app, settings, tls)
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
    from registry_client.paths import normalize_urls

    token = args.token or os.environ.get("REGISTRY_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        urls = normalize_urls(args.url)
        tls = client_tls(args)
    except ValueError as exc:
        print(f"engine-registry status: {exc}", file=sys.stderr)
        return 2
    if args.watch:
        from registry_client.status_view import Watch

        if args.interval < 0.2:
            print("engine-registry status: --interval must be at least 0.2 s", file=sys.stderr)
            return 2
        timeout = min(args.timeout, max(1.0, args.interval))
        color = sys.stdout.isatty()
        return Watch(
            args.url,
            headers,
            args.interval,
            timeout,
            format_groups,
            color=color,
            verify=tls.context,
        ).run()
    failures: list[str] = []
    with httpx.Client(headers=headers, timeout=args.timeout, verify=tls.context) as http:
        for url in urls:  # replicas in turn, as probe and router-sync: the first that answers
            try:
                answer = http.get(f"{url}/tp-groups")
                # Admins only (others get 401/403 and see no line): the tokens generation.
                tokens = http.get(f"{url}/admin/tokens") if answer.status_code == 200 else None
                break
            except httpx.HTTPError as exc:
                failures.append(unreachable(exc, url, tls))
        else:
            print(f"engine-registry: {'; '.join(failures)}", file=sys.stderr)
            return 1
    if answer.status_code != 200:
        try:
            detail = answer.json().get("detail", answer.text)
        except ValueError:
            detail = answer.text
        print(f"engine-registry: {url} answered {answer.status_code}: {detail}", file=sys.stderr)
        return 1
    groups = answer.json()["groups"]
    print(format_groups(groups) if groups else "no groups")
    if tokens is not None and tokens.status_code == 200:
        print(format_tokens(tokens.json()))
    return 0


def format_tokens(status: dict[str, Any]) -> str:
    """The admin line of ``status``: which tokens file generation the registry enforces."""
    if not status.get("enabled"):
        return "tokens: none (authentication off)"
    roles = ", ".join(f"{n} {role}" for role, n in sorted(status.get("roles", {}).items()))
    where = (
        f"file {status['tokens_file']} sha256 {str(status.get('sha256') or '')[:12]}"
        if status.get("tokens_file")
        else "REGISTRY_TOKENS only"
    )
    return (
        f"tokens: generation {status['generation']}, loaded {status['loaded_at']}, "
        f"{where} ({roles}; pid {status.get('pid')})"
    )


# -- probe: is this group's engine ready? (a Kubernetes readiness/startup probe) ------------

PROBE_READY, PROBE_NOT_READY, PROBE_USAGE, PROBE_UNREACHABLE = 0, 1, 2, 3


def _probe_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            with open(args.token_file) as f:
                lines = f.read().split()
        except OSError as exc:
            raise ValueError(f"cannot read --token-file {args.token_file}: {exc}") from None
        if not lines:
            raise ValueError(f"--token-file {args.token_file} is empty")
        return lines[0]
    token = os.environ.get("REGISTRY_TOKEN") or os.environ.get("ENGINE_REGISTRY_TOKEN") or ""
    return token.strip() or None


def probe_verdict(engine: dict[str, Any], launch_id: str | None) -> tuple[bool, str]:
    """(ready, why) for one GET /tp-groups/{group}/engine answer."""
    where = f"group {engine['group_id']} generation {engine['generation']}"
    if launch_id and engine.get("launch_id") != launch_id:
        return False, (
            f"not ready: {where} belongs to launch {engine.get('launch_id')}, not this one "
            f"({launch_id}); its rank 0 has not opened this launch's engine yet"
        )
    ranks = f"{len(engine['registered_ranks'])}/{engine['tp_size']} ranks registered"
    if engine["ready"]:
        return True, f"ready: {where}, engine {engine['engine_id']}, {ranks}"
    missing = ",".join(str(r) for r in engine["missing_ranks"])
    return False, f"not ready: {where}, {ranks}, missing ranks {missing}"


def _probe(args: argparse.Namespace) -> int:
    """Exit 0 when the group's current engine (of --launch-id, if given) has every rank."""
    if not args.group:
        print(
            "engine-registry probe: --group (or ENGINE_REGISTRY_GROUP) is required", file=sys.stderr
        )
        return PROBE_USAGE
    try:
        token = _probe_token(args)
    except ValueError as exc:
        print(f"engine-registry probe: {exc}", file=sys.stderr)
        return PROBE_USAGE
    try:
        tls = client_tls(args)
    except ValueError as exc:
        print(f"engine-registry probe: {exc}", file=sys.stderr)
        return PROBE_USAGE
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + args.timeout
    urls = [u.strip().rstrip("/") for u in args.url.split(",") if u.strip()]
    failures: list[str] = []
    for url in urls:  # replicas in turn, all within the one deadline
        left = deadline - time.monotonic()
        if left <= 0:
            failures.append(f"{url}: no time left of --timeout {args.timeout:g}s")
            continue
        try:
            answer = httpx.get(
                f"{url}/tp-groups/{args.group}/engine",
                headers=headers,
                timeout=left,
                verify=tls.context,
            )
        except httpx.HTTPError as exc:
            failures.append(f"{url}: {type(exc).__name__}: {unreachable(exc, url, tls)}")
            continue
        if answer.status_code == 404:
            print(
                f"not ready: group {args.group} has no engine at {url} yet "
                "(its rank 0 has not opened one)"
            )
            return PROBE_NOT_READY
        if answer.status_code != 200:
            failures.append(f"{url} answered {answer.status_code}: {answer.text[:300]}")
            continue
        ready, why = probe_verdict(answer.json(), args.launch_id)
        print(why)
        return PROBE_READY if ready else PROBE_NOT_READY
    print(
        f"engine-registry probe: cannot ask any registry about group {args.group}: "
        + "; ".join(failures)
        + " (check --url, the token's role, and that the registry serves)",
        file=sys.stderr,
    )
    return PROBE_UNREACHABLE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-registry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the registry service")
    add_settings_flags(serve)
    serve.set_defaults(func=_serve)

    status = sub.add_parser("status", help="show a running registry's groups as a table")
    status.add_argument(
        "--url",
        default=os.environ.get("REGISTRY_URL", DEFAULT_URL),
        help="registry URL(s), comma-separated replicas: the first that answers (REGISTRY_URL)",
    )
    status.add_argument("--token", help="bearer token (or REGISTRY_TOKEN)")
    status.add_argument("--timeout", type=float, default=10.0)
    status.add_argument(
        "--watch", action="store_true", help="redraw the table in place, changes marked"
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between frames of --watch"
    )
    add_tls_flags(status)
    status.set_defaults(func=_status)

    probe = sub.add_parser(
        "probe",
        help="exit 0 when a group's engine has every rank registered (readiness probe)",
        description="Exit codes: 0 ready; 1 not ready (no engine yet, another launch's "
        "engine, or ranks missing: printed); 2 usage (no group, unreadable token file); "
        "3 no registry answered within --timeout.",
    )
    probe.add_argument(
        "--url",
        default=os.environ.get("REGISTRY_URL")
        or os.environ.get("ENGINE_REGISTRY_URL")
        or DEFAULT_URL,
        help="registry URL(s), comma-separated replicas (REGISTRY_URL, ENGINE_REGISTRY_URL)",
    )
    probe.add_argument(
        "--group",
        default=os.environ.get("ENGINE_REGISTRY_GROUP"),
        help="the TP group id (ENGINE_REGISTRY_GROUP)",
    )
    probe.add_argument(
        "--launch-id",
        default=os.environ.get("ENGINE_REGISTRY_LAUNCH_ID") or None,
        help="ready only if the current engine is this launch's (ENGINE_REGISTRY_LAUNCH_ID)",
    )
    probe.add_argument(
        "--token-file",
        help="file whose first line is the bearer token; "
        "else REGISTRY_TOKEN or ENGINE_REGISTRY_TOKEN",
    )
    probe.add_argument("--timeout", type=float, default=5.0, help="deadline for the whole probe")
    add_tls_flags(probe)
    probe.set_defaults(func=_probe)

    from registry_client.router_sync.cli import add_command as add_router_sync

    add_router_sync(sub, add_tls_flags)

    demo = sub.add_parser(
        "demo",
        help="prefill/decode demo on this machine (needs the workers extra)",
        add_help=False,
    )
    demo.set_defaults(func=None)
    return parser


DEMO = "workers.tools.demo"


def _demo(argv: list[str]) -> int:
    """The demo lives with the worker library (``workers.tools.demo``), which the service
    never imports: this process becomes it (same pid, signals and exit status)."""
    if importlib.util.find_spec(DEMO.split(".")[0]) is None:  # finds, imports nothing
        print(
            "engine-registry demo needs the workers extra "
            "(pip install 'engine-registry[workers]'): no workers package",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", DEMO, *argv])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return _demo(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
