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

A token a reload drops is revoked: new requests get 401, and the streams it opened (``hold``:
watches, keep-alive streams) end at once with a final ``ERROR`` line, code ``unauthorized``. A
stream whose token's new role is below what the stream needs (a keep-alive stream: worker)
ends the same way with ``forbidden``; otherwise the stream's request credential becomes the
token's current one, so a changed ``groups=`` applies from its next message. One stream that
cannot be ended is logged and never keeps the others open.
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
from typing import Any, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.types import Scope

from app.core.periodic import every
from app.core.problems import error_line
from app.security.auth import (
    CREDENTIAL,
    TokenFileError,
    Tokens,
    inline_tokens,
    parse_tokens,
    read_tokens_file,
)
from app.security.credentials import ROLES, Credential, RoleName

log = logging.getLogger("app")

CHECK_INTERVAL_S = 1.0
SETTLE_S = 1.0  # a file modified this recently may be half written: not read on SIGHUP
FileId = tuple[int, int, int]  # inode, size, mtime in ns
_UNSEEN: FileId = (-1, -1, -1)


class Held(Protocol):
    """What a token holds open (a watch stream, app/watch/stream.py; a keep-alive stream,
    app/api/routes/keepalive.py): ended on revocation."""

    revision: int

    def finish(self, line: bytes, *, slow: bool = False) -> None: ...


@dataclass(slots=True)
class _Hold:
    state: dict[str, Any]  # the request's scope["state"]: its credential, read per message
    needs: RoleName  # the role the stream was opened with (and must keep)


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
        self._held: weakref.WeakKeyDictionary[Held, _Hold] = weakref.WeakKeyDictionary()

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

    def hold(self, stream: Held, scope: Scope, needs: RoleName = "reader") -> None:
        """``stream`` was opened by the request of ``scope``, which needed role ``needs``: each
        reload applies the tokens in force to it (``revoke``). Held weakly; the stream's
        owner ``release``s it when it ends (an ended stream may live on until the cyclic GC)."""
        state = scope.get("state")
        if state is not None and state.get(CREDENTIAL) is not None:
            self._held[stream] = _Hold(state, needs)

    def release(self, stream: Held) -> None:
        self._held.pop(stream, None)

    def revoke(self) -> int:
        """Apply the tokens in force to every held stream (see the module's docstring); how
        many ended."""
        ended = 0
        for stream, held in list(self._held.items()):
            try:
                ended += self._follow(stream, held)
            except Exception:  # one stream's failure must not keep the others open
                self._held.pop(stream, None)
                log.exception("a stream of a changed token could not be ended")
        if ended:
            log.info(
                "streams of removed or demoted tokens ended",
                extra={"streams": ended, "generation": self.generation.number},
            )
        return ended

    def _follow(self, stream: Held, held: _Hold) -> bool:
        """The stream's credential made the token's current one, or the stream ended (True)."""
        old: Credential = held.state[CREDENTIAL]
        new = self.tokens.get(old.digest)
        if new is not None and ROLES[new.role] >= ROLES[held.needs]:
            if new != old:
                held.state[CREDENTIAL] = new
                held.state["role"] = new.role
            return False
        del self._held[stream]
        number = self.generation.number
        if new is None:
            code, status = "unauthorized", 401
            detail = (
                f"The token {old.name!r} that opened this stream was removed from the tokens "
                f"file (generation {number}): open it again (a watch: from this revision) with a "
                "token in force."
            )
        else:
            code, status = "forbidden", 403
            detail = (
                f"The token {old.name!r} that opened this stream is a {new.role} token since "
                f"generation {number} of the tokens file; this stream needs {held.needs}."
            )
        stream.finish(error_line(stream.revision, code, status, detail))
        return True

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
