"""Keep-alive stream helpers for tests (``GET /keepalive``)."""

from __future__ import annotations

import json

from websockets.sync.client import ClientConnection


def renew_pipelined(
    ws: ClientConnection, group: str, engine_id: str, asked: list[list[int] | None]
) -> None:
    """Send each renewal of ``asked`` back to back (``None``: a malformed one), then check the
    answers come one each, in order, a refused one (422) in its place."""
    for ranks in asked:
        ws.send(json.dumps([group, engine_id, ranks]) if ranks else "[]")
    for ranks in asked:
        answer = json.loads(ws.recv(timeout=10))
        if ranks is None:
            assert answer["status"] == 422, answer
        else:
            assert [a["rank"] for a in answer["agents"]] == ranks, (ranks, answer)
