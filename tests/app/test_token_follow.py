"""app/security/tokens.py's ``TokenSource.revoke`` on its own, with a real tokens file: a held
stream that cannot be ended (its ``finish`` raises) is logged and forgotten and never keeps the
other streams of a dropped token open; a released stream is no longer judged."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from app.security.auth import CREDENTIAL
from app.security.tokens import TokenSource

pytestmark = pytest.mark.unit

KEPT = "worker:follow-kept-token-0123456789"
GONE = "worker:follow-gone-token-0123456789:name=gone"


class Ending:
    """A held stream: records its last line, or raises as an ended one once did."""

    revision = 7

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.lines: list[bytes] = []

    def finish(self, line: bytes, *, slow: bool = False) -> None:
        if self.broken:
            raise RuntimeError("Cannot change state of finished Timeout")
        self.lines.append(line)


def write(path: Path, *lines: str) -> None:
    path.write_text("".join(f"{line}\n" for line in lines))
    past = time.time() - 5
    os.utime(path, (past, past))


def test_one_stream_that_cannot_end_never_keeps_the_others_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    write(path, KEPT, GONE)
    source = TokenSource(path, None)
    gone = next(c for c in source.tokens.values() if c.name == "gone")
    streams = [Ending(), Ending(broken=True), Ending(), Ending()]
    scopes: list[dict[str, Any]] = [{"state": {CREDENTIAL: gone}} for _ in streams]
    for stream, scope in zip(streams, scopes, strict=True):
        source.hold(stream, scope)
    source.release(streams[3])  # ended on its own: not judged again
    write(path, KEPT)
    with caplog.at_level(logging.INFO, logger="app"):
        assert source.reload("test")
    assert [len(s.lines) for s in streams] == [1, 0, 1, 0]
    assert b'"unauthorized"' in streams[0].lines[0]
    assert b"'gone'" in streams[0].lines[0]
    failed = [r for r in caplog.records if "could not be ended" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].exc_info is not None
    assert source.revoke() == 0  # each judged once: none is held any more
