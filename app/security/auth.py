"""Bearer tokens with three roles, checked in a pure ASGI middleware before anything else.

Checking here (and not in a FastAPI dependency) keeps the contract's order: an unauthorized
request gets 401 even when its body is malformed, which FastAPI would otherwise parse first.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.errors import Forbidden, RegistryError, Unauthorized
from app.core.problems import problem_answer, send_problem
from app.security.credentials import (
    ACTOR,
    ROLES,
    Credential,
    RoleName,
    TokenFileError,
    Tokens,
    digest_of,
    inline_tokens,
    parse_tokens,
)
from app.security.credentials import Scope as CredentialScope

__all__ = ["TokenFileError", "Tokens", "inline_tokens", "parse_tokens"]

CREDENTIAL = "credential"  # scope["state"]: the request's Credential, once authenticated

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


def credential_of(tokens: Tokens, presented: str) -> Credential | None:
    """One sha256 and one dictionary lookup, whatever the number of tokens: the digest an
    attacker could time is of their own guess, never of a token in force."""
    return tokens.get(digest_of(presented)) if presented else None


def role_of(tokens: Tokens, presented: str) -> RoleName | None:
    credential = credential_of(tokens, presented)
    return None if credential is None else credential.role


class OutOfScope(Forbidden):
    code = "out_of_scope"
    title = "Outside this token's scope"


def out_of_scope(credential: Credential, group_id: str, what: str) -> OutOfScope:
    return OutOfScope(
        f"The token {credential.name!r} may write only the groups {credential.scope} "
        f"(its groups= in the tokens file); {what} {group_id!r} is outside them. Use the "
        "token of the node that runs this group, or widen the token's groups=.",
        token_name=credential.name,
        scope=list(credential.scope.patterns) if credential.scope else None,
        group_id=group_id,
    )


def _path_scope(credential: Credential, allowed: CredentialScope, path: str) -> OutOfScope | None:
    """A write under ``/tp-groups/{id}``: the id must be in the token's scope."""
    if path.startswith("/tp-groups/"):
        group_id = path[11:].partition("/")[0]
        if not allowed.allows(group_id):
            return out_of_scope(credential, group_id, "the group")
    return None


def check_scope(scope: Scope, group_id: str, what: str = "group") -> None:
    """A handler's check of a group named in a body (the handshake's ``decode``): raises
    ``OutOfScope`` when the request's token is scoped and ``group_id`` is outside it."""
    credential = scope.get("state", {}).get(CREDENTIAL)
    if credential is None or credential.scope is None or credential.scope.allows(group_id):
        return
    raise out_of_scope(credential, group_id, what)


def acting(scope: Scope) -> None:
    """The request's token name, for the events it causes (``ACTOR``)."""
    credential = scope.get("state", {}).get(CREDENTIAL)
    if credential is not None:
        ACTOR.set(credential.name)


WEBSOCKET = "WEBSOCKET"  # the method a WebSocket upgrade is judged as (a write: worker)


async def send_refusal(
    send: Send, error: RegistryError, scope: Scope, extra_headers: list[tuple[bytes, bytes]]
) -> None:
    """The problem+json answer to a request, or to a WebSocket upgrade refused before it is
    accepted (the ASGI denial response; a server without it closes the upgrade: 403)."""
    if scope["type"] == "http":
        await send_problem(send, error, scope, extra_headers=extra_headers)
        return
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": error.code})
        return
    status, headers, body = problem_answer(error, scope, extra_headers)
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


class TokensHolder(Protocol):
    """Where the tokens in force are read per request (``app.security.tokens.TokenSource``)."""

    tokens: Tokens


class AuthMiddleware:
    """``source.tokens`` is read once per request: a reload swaps it between requests."""

    def __init__(self, app: ASGIApp, source: TokensHolder) -> None:
        self.app = app
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tokens = self.source.tokens
        kind = scope["type"]
        if kind not in ("http", "websocket") or not tokens:
            await self.app(scope, receive, send)
            return
        # A WebSocket upgrade (the keep-alive stream) renews leases: it needs a worker token.
        method = scope["method"] if kind == "http" else WEBSOCKET
        needed = required_role(method, scope["path"])
        if needed is None:
            await self.app(scope, receive, send)
            return
        error = self.verdict(scope, tokens, needed, method)
        if error is None:
            acting(scope)
            await self.app(scope, receive, send)
            return
        headers = [(b"www-authenticate", b'Bearer realm="engine-registry"')]
        if scope["path"] in BROWSER_PATHS:
            headers.append((b"www-authenticate", b'Basic realm="engine-registry", charset="UTF-8"'))
        await send_refusal(send, error, scope, headers if error.status == 401 else [])

    @staticmethod
    def verdict(
        scope: Scope, tokens: Tokens, needed: RoleName, method: str | None = None
    ) -> RegistryError | None:
        """None when the request's credentials hold role ``needed`` and, for a scoped
        worker token's write to ``/tp-groups/{id}/…``, the group is in its scope (the role
        and the ``Credential`` are then in ``scope["state"]``); else the refusal."""
        error: RegistryError | None = None
        method = method or scope["method"]
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, presented = header.partition(" ")
        scheme = scheme.lower()
        if scheme == "basic" and method in BASIC_METHODS:
            scheme, presented = "bearer", basic_password(presented)
        credential = credential_of(tokens, presented.strip()) if scheme == "bearer" else None
        if credential is None:
            error = Unauthorized(
                "A valid bearer token is required: send 'Authorization: Bearer <token>' with a "
                "token from the registry's tokens file."
                if header
                else "No credentials: send 'Authorization: Bearer <token>'."
            )
        elif ROLES[credential.role] < ROLES[needed]:
            error = Forbidden(
                f"This token's role is {credential.role}; {method} {scope['path']} needs {needed}."
            )
        elif needed == "worker" and credential.scope is not None:
            error = _path_scope(credential, credential.scope, scope["path"])
        if error is None:
            state = scope.setdefault("state", {})
            state["role"] = credential.role  # type: ignore[union-attr]
            state[CREDENTIAL] = credential
        return error
