"""Bearer tokens with three roles, checked in a pure ASGI middleware before anything else.

Checking here (and not in a FastAPI dependency) keeps the contract's order: an unauthorized
request gets 401 even when its body is malformed, which FastAPI would otherwise parse first.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import stat
from pathlib import Path
from typing import Literal, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import Forbidden, RegistryError, Unauthorized
from app.problems import send_problem

RoleName = Literal["reader", "worker", "admin"]
ROLES: dict[str, int] = {"reader": 0, "worker": 1, "admin": 2}
Tokens = dict[str, RoleName]

PUBLIC_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)


# Browsers cannot send a bearer header; they can send HTTP Basic credentials (any user name,
# the token as the password) and prompt for them when challenged. Accepted on reads only, so
# credentials a browser caches can never change state (no cross-site POST rides on them).
BASIC_METHODS = frozenset({"GET", "HEAD"})
BROWSER_PATHS = frozenset({"/status", "/events"})


def basic_password(value: str) -> str:
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return ""
    return decoded.partition(":")[2]


class TokenFileError(ValueError):
    pass


def parse_tokens(text: str, *, source: str) -> Tokens:
    """``role:token`` a line, ``#`` comments. Errors name the line, never the token."""
    tokens: Tokens = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        role, sep, token = line.partition(":")
        role, token = role.strip(), token.strip()
        if not sep or role not in ROLES or not token:
            raise TokenFileError(
                f"{source} line {number}: expected 'role:token' with role reader, worker or admin"
            )
        if len(token) < 16:
            raise TokenFileError(f"{source} line {number}: token shorter than 16 characters")
        tokens[token] = role  # type: ignore[assignment]
    return tokens


def inline_tokens(text: str) -> Tokens:
    """``REGISTRY_TOKENS``: ``role:token`` pairs separated by commas."""
    return parse_tokens(text.replace(",", "\n"), source="REGISTRY_TOKENS")


TOKENS_FILE_BYTES = 1024 * 1024


def read_tokens_file(path: Path) -> bytes:
    """The file's bytes. Opened without blocking and read only when it is a regular file of
    at most ``TOKENS_FILE_BYTES``: a FIFO, a device or a socket put in its place is refused
    at once (it would block the event loop that reads it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise TokenFileError(f"cannot read tokens file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"tokens file {path} is not a regular file")
        if st.st_size > TOKENS_FILE_BYTES:
            raise TokenFileError(
                f"tokens file {path} is larger than {TOKENS_FILE_BYTES} bytes ({st.st_size})"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise TokenFileError(f"cannot read tokens file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def required_role(method: str, path: str) -> RoleName | None:
    """None for public paths; admin to delete a group and for /admin/…; reader for reads;
    worker otherwise."""
    if path in PUBLIC_PATHS:
        return None
    parts = [p for p in path.split("/") if p]
    if method == "DELETE" and len(parts) == 2 and parts[0] == "tp-groups":
        return "admin"
    if parts and parts[0] == "admin":
        return "admin"
    if method in {"GET", "HEAD", "OPTIONS"}:
        return "reader"
    return "worker"


def role_of(tokens: Tokens, presented: str) -> RoleName | None:
    """Compare against every token in constant time (no early exit on a match)."""
    found: RoleName | None = None
    candidate = presented.encode()
    for token, role in tokens.items():
        if hmac.compare_digest(token.encode(), candidate):
            found = role
    return found


class TokensHolder(Protocol):
    """Where the tokens in force are read per request (``app.tokens.TokenSource``)."""

    tokens: Tokens


class AuthMiddleware:
    """``source.tokens`` is read once per request: a reload swaps it between requests."""

    def __init__(self, app: ASGIApp, source: TokensHolder) -> None:
        self.app = app
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tokens = self.source.tokens
        if scope["type"] != "http" or not tokens:
            await self.app(scope, receive, send)
            return
        needed = required_role(scope["method"], scope["path"])
        if needed is None:
            await self.app(scope, receive, send)
            return
        error = self.verdict(scope, tokens, needed)
        if error is None:
            await self.app(scope, receive, send)
            return
        headers = [(b"www-authenticate", b'Bearer realm="engine-registry"')]
        if scope["path"] in BROWSER_PATHS:
            headers.append((b"www-authenticate", b'Basic realm="engine-registry", charset="UTF-8"'))
        await send_problem(send, error, scope, extra_headers=headers if error.status == 401 else [])

    @staticmethod
    def verdict(scope: Scope, tokens: Tokens, needed: RoleName) -> RegistryError | None:
        """None when the request's credentials hold role ``needed`` (the role is then in
        ``scope["state"]``); else the refusal."""
        error: RegistryError | None = None
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, presented = header.partition(" ")
        scheme = scheme.lower()
        if scheme == "basic" and scope["method"] in BASIC_METHODS:
            scheme, presented = "bearer", basic_password(presented)
        role = role_of(tokens, presented.strip()) if scheme == "bearer" else None
        if role is None:
            error = Unauthorized(
                "A valid bearer token is required: send 'Authorization: Bearer <token>' with a "
                "token from the registry's tokens file."
                if header
                else "No credentials: send 'Authorization: Bearer <token>'."
            )
        elif ROLES[role] < ROLES[needed]:
            error = Forbidden(
                f"This token's role is {role}; {scope['method']} {scope['path']} needs {needed}."
            )
        if error is None:
            scope.setdefault("state", {})["role"] = role
        return error
