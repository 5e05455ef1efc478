"""The tokens in force, reloaded without a restart: on SIGHUP, and when the file changes.

``REGISTRY_TOKENS_FILE`` is read again on ``SIGHUP`` and when its identity (inode, size,
mtime) changes and then holds still for one check (checks run once a second, off the request
path). A reload swaps one reference: ``AuthMiddleware`` reads ``TokenSource.tokens`` per
request and nothing else. Tokens present in both files stay valid across the swap, so a
rotation adds the new token, rolls the clients over, then drops the old one.

A file modified less than ``SETTLE_S`` ago is not read on ``SIGHUP``: it may be half
rewritten in place; the poller reloads it once it holds still. A file that is not a regular
file (a FIFO, a device) is refused without being opened for a blocking read.

A file that does not parse, cannot be read, or has no token at all keeps the previous tokens
in force; the error log names the file and the line (never a token). Each accepted reload
is a new *generation*: its number, when it was loaded and the sha256 of the file's bytes are
shown to admins at ``GET /admin/tokens`` (and by ``engine-registry status``).

A token a reload drops is revoked: new requests get 401, and the watch streams it opened
(``hold``) end at once with a final ``ERROR`` line, code ``unauthorized``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app.core.periodic import every
from app.core.problems import error_line
from app.security.auth import TokenFileError, Tokens, inline_tokens, parse_tokens, read_tokens_file
from app.security.credentials import Credential

log = logging.getLogger("app")

CHECK_INTERVAL_S = 1.0
SETTLE_S = 1.0  # a file modified this recently may be half written: not read on SIGHUP
FileId = tuple[int, int, int]  # inode, size, mtime in ns
_UNSEEN: FileId = (-1, -1, -1)


class Held(Protocol):
    """What a token holds open (a watch stream, app/watch/stream.py): ended on revocation."""

    revision: int

    def finish(self, line: bytes, *, slow: bool = False) -> None: ...


@dataclass(frozen=True)
class TokenGeneration:
    tokens: Tokens
    number: int
    loaded_at: datetime
    sha256: str | None  # of the tokens file's bytes, None without a file
    file_id: FileId | None


def _file_id(path: Path) -> FileId | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class TokenSource:
    """The tokens file plus the inline ``REGISTRY_TOKENS``; ``tokens`` is what is in force."""

    def __init__(self, path: Path | None, inline: str | None) -> None:
        self.path = path
        self.inline = inline
        self.generation = self._load(1)  # a bad file stops the start (TokenFileError)
        self.tokens: Tokens = self.generation.tokens
        self._pending: FileId | None = _UNSEEN  # a change seen once, reloaded if it holds
        self._failed: FileId | None = _UNSEEN  # the file as it was when a reload failed
        self._held: weakref.WeakKeyDictionary[Held, Credential] = weakref.WeakKeyDictionary()

    def _load(self, number: int) -> TokenGeneration:
        tokens: Tokens = {}
        digest: str | None = None
        file_id: FileId | None = None
        if self.path is not None:
            file_id = _file_id(self.path)
            data = read_tokens_file(self.path)
            tokens.update(parse_tokens(data.decode("utf-8", "replace"), source=str(self.path)))
            digest = hashlib.sha256(data).hexdigest()
        if self.inline:
            tokens.update(inline_tokens(self.inline))
        return TokenGeneration(tokens, number, datetime.now(UTC), digest, file_id)

    def reload(self, why: str) -> bool:
        """Read the file again; True when a new generation is in force."""
        if self.path is None:
            return False
        current = self.generation
        try:
            new = self._load(current.number + 1)
            if current.tokens and not new.tokens:
                raise TokenFileError(
                    f"{self.path} has no tokens; a reload never turns authentication off "
                    "(restart without REGISTRY_TOKENS_FILE to do that)"
                )
        except TokenFileError as exc:
            self._pending = _UNSEEN
            self._failed = _file_id(self.path)
            log.error(
                f"tokens file not reloaded, generation {current.number} stays in force: {exc}",
                extra={"tokens_file": str(self.path), "trigger": why},
            )
            return False
        if new.sha256 == current.sha256 and new.tokens == current.tokens:
            self.generation = TokenGeneration(
                current.tokens, current.number, current.loaded_at, current.sha256, new.file_id
            )
            return False
        self.generation = new
        self.tokens = new.tokens
        self._pending = _UNSEEN
        self.revoke()
        log.info(
            "tokens file reloaded",
            extra={
                "tokens_file": str(self.path),
                "generation": new.number,
                "sha256": (new.sha256 or "")[:12],
                "trigger": why,
                **{f"{role}_tokens": n for role, n in sorted(self.counts().items())},
            },
        )
        return True

    def on_sighup(self) -> None:
        """SIGHUP: reload now if the file has held still for ``SETTLE_S``; else leave it to
        the poller, which reloads a changed file once it holds still for a check."""
        if self.path is None:
            return
        try:
            age_s = time.time() - self.path.stat().st_mtime
        except OSError:
            age_s = SETTLE_S  # reload() says what is wrong with it
        if age_s >= SETTLE_S:
            self.reload("SIGHUP")
            return
        log.info(
            "tokens file modified under a second ago: reloaded once it holds still",
            extra={"tokens_file": str(self.path), "trigger": "SIGHUP"},
        )
        self._pending = _UNSEEN

    def check(self) -> None:
        """Reload when the file changed and held still since the previous check."""
        if self.path is None:
            return
        seen = _file_id(self.path)
        if seen in (self.generation.file_id, self._failed):
            self._pending = _UNSEEN
        elif seen == self._pending:
            self.reload("file changed")
        else:
            self._pending = seen

    def counts(self) -> dict[str, int]:
        return dict(Counter(credential.role for credential in self.tokens.values()))

    def hold(self, stream: Held, credential: Credential | None) -> None:
        """``stream`` (a watch) was opened with ``credential``: a reload that drops the
        token ends it (``revoke``). Held weakly: an ended stream is forgotten with it."""
        if credential is not None:
            self._held[stream] = credential

    def revoke(self) -> int:
        """End every held stream whose token is no longer in force, with a final ``ERROR``
        line (``unauthorized``); how many."""
        ended = 0
        for stream, credential in list(self._held.items()):
            if credential.digest in self.tokens:
                continue
            del self._held[stream]
            stream.finish(
                error_line(
                    stream.revision,
                    "unauthorized",
                    401,
                    f"The token {credential.name!r} that opened this stream was removed from "
                    f"the tokens file (generation {self.generation.number}): watch again from "
                    "this revision with a token in force.",
                )
            )
            ended += 1
        if ended:
            log.info(
                "watch streams of removed tokens ended",
                extra={"streams": ended, "generation": self.generation.number},
            )
        return ended

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """While the app serves: reload on SIGHUP (main thread only) and on change."""
        if self.path is None:
            yield
            return
        loop = asyncio.get_running_loop()
        on_signal = threading.current_thread() is threading.main_thread()
        if on_signal:
            loop.add_signal_handler(signal.SIGHUP, self.on_sighup)

        try:
            async with every(CHECK_INTERVAL_S, self.check, "tokens-file-watch"):
                yield
        finally:
            if on_signal:
                loop.remove_signal_handler(signal.SIGHUP)


# -- GET /admin/tokens ---------------------------------------------------------------------


class TokensStatus(BaseModel):
    enabled: bool = Field(description="false: no tokens, the registry serves without auth")
    generation: int = Field(description="1 at start, +1 on each accepted reload")
    loaded_at: datetime = Field(description="when this generation was read (UTC)")
    tokens_file: str | None = Field(description="REGISTRY_TOKENS_FILE, if any")
    sha256: str | None = Field(description="sha256 of the tokens file's bytes (hex)")
    roles: dict[str, int] = Field(description="tokens in force by role")
    pid: int = Field(description="the process answering (each replica has its own)")


router = APIRouter(tags=["admin"])


@router.get(
    "/admin/tokens",
    summary="The tokens file generation in force (admin role)",
    response_model=TokensStatus,
)
async def tokens_status(request: Request) -> TokensStatus:
    source: TokenSource = request.app.state.tokens
    generation = source.generation
    return TokensStatus(
        enabled=bool(source.tokens),
        generation=generation.number,
        loaded_at=generation.loaded_at,
        tokens_file=str(source.path) if source.path else None,
        sha256=generation.sha256,
        roles=source.counts(),
        pid=os.getpid(),
    )
