"""``python -m bench.auth_cost [--groups N] [--tokens N] [--plain]``: what bearer tokens add to a
node heartbeat on the registry's whole server path (``bench.wire_cost``'s in-process run: the
wire path, the handler, a real SQLite store, no sockets), one row each: no tokens, one worker
token, and ``--tokens`` worker tokens (one a node, as docs/security.md recommends), each
scoped to its node's groups unless ``--plain`` (the form a registry without scopes reads).
Every request carries the last token's ``Authorization`` header, scoped to every group the
run opens (``*``). Nothing is asserted: CPU per heartbeat, best and median round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

from bench import wire_cost
from bench.raw_client import RawPool


def _tokens(n: int, plain: bool) -> tuple[str, str]:
    """``REGISTRY_TOKENS`` with ``n`` worker tokens, and the one requests present."""
    made = [f"node{i}-{uuid.uuid4().hex}" for i in range(n)]
    scope = [f":name=node-{i}:groups=node{i}-*" for i in range(n - 1)] + [":name=all:groups=*"]
    lines = [f"worker:{t}" + ("" if plain else s) for t, s in zip(made, scope, strict=True)]
    return ",".join(lines), made[-1]


def run(groups: int, tokens: int, plain: bool) -> dict[str, Any]:
    prepare = RawPool.prepare
    inline, presented = _tokens(tokens, plain) if tokens else ("", "")

    def with_token(method: str, path: str, body: Any = None) -> bytes:
        data = prepare(method, path, body)
        return data.replace(b"\r\n", f"\r\nauthorization: Bearer {presented}\r\n".encode(), 1)

    os.environ.pop("REGISTRY_TOKENS", None)
    if tokens:
        os.environ["REGISTRY_TOKENS"] = inline
        RawPool.prepare = staticmethod(with_token)  # type: ignore[method-assign]
    try:
        result = asyncio.run(wire_cost.measure(groups, 1, None))
    finally:
        RawPool.prepare = staticmethod(prepare)  # type: ignore[method-assign]
        os.environ.pop("REGISTRY_TOKENS", None)
    return {"tokens": tokens, "scoped": bool(tokens) and not plain, **result["heartbeat_cpu_us"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1250)
    parser.add_argument("--plain", action="store_true", help="tokens without name= or groups=")
    args = parser.parse_args(argv)
    for n in (0, 1, args.tokens):
        print(json.dumps(run(args.groups, n, args.plain)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
