"""The tokens file's lines: a role, a token, and optionally a name and a scope.

    role:token[:name=NAME][:groups=PATTERN,PATTERN...]

``role`` is reader, worker or admin; ``token`` at least 16 characters. ``name`` (letters,
digits, ``.``, ``_``, ``-``; at most 64) is what logs, events and refusals call the token;
without one a token is called ``{role}#{line}`` (``inline-{role}#{entry}`` from
``REGISTRY_TOKENS``). ``groups`` (worker tokens only) limits the groups the token may write:
group ids, or patterns where ``*`` stands for any run of characters and ``?`` for one
(``prefill-node7-*``). A line without ``groups`` is unscoped: it may write every group. A
``role:token`` line of an older file reads as before (an unscoped token called by its line).

Tokens are kept by their sha256 digest only: a request's token is found with one hash and one
dictionary lookup however many tokens there are (one a node in a fleet), and the registry's
memory never holds a token in clear. Errors name the source and the line, never a token.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from dataclasses import dataclass, field
from typing import Literal

RoleName = Literal["reader", "worker", "admin"]
ROLES: dict[str, int] = {"reader": 0, "worker": 1, "admin": 2}
MIN_TOKEN = 16
# The name of the token whose request is being answered (set by app/security/auth.py per request):
# the events it causes name it (app/registry/events.py).
ACTOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("actor", default=None)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PATTERN = re.compile(r"[a-z0-9._*?-]{1,64}")
_OPTION = re.compile(r":(name|groups)=", re.ASCII)


class TokenFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Scope:
    """The group ids (and ``*``/``?`` patterns) a token may write."""

    patterns: tuple[str, ...]
    _exact: frozenset[str] = field(init=False, compare=False, repr=False)
    _match: re.Pattern[str] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        exact = frozenset(p for p in self.patterns if "*" not in p and "?" not in p)
        wild = [p for p in self.patterns if p not in exact]
        regex = "|".join(
            "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in p)
            for p in wild
        )
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(self, "_match", re.compile(regex) if wild else None)

    def allows(self, group_id: str) -> bool:
        """One set lookup, then (for patterns) one precompiled ``fullmatch``."""
        if group_id in self._exact:
            return True
        return self._match is not None and self._match.fullmatch(group_id) is not None

    def __str__(self) -> str:
        return ",".join(self.patterns)


@dataclass(frozen=True, slots=True)
class Credential:
    """What a token may do, and what it is called: never the token itself."""

    role: RoleName
    name: str
    scope: Scope | None = None  # None: every group
    digest: bytes = b""  # sha256 of the token: which streams end when it is revoked


Tokens = dict[bytes, Credential]  # sha256(token) -> credential


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _options(rest: str, where: str) -> tuple[str, dict[str, str]]:
    """The token and the ``:key=value`` options after it (a token may itself hold ``:``)."""
    found = _OPTION.search(rest)
    token, tail = (rest, "") if found is None else (rest[: found.start()], rest[found.start() :])
    options: dict[str, str] = {}
    for part in tail.split(":")[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("name", "groups"):
            raise TokenFileError(f"{where}: unknown option {key!r} (expected name= or groups=)")
        if key in options:
            raise TokenFileError(f"{where}: {key}= given twice")
        options[key] = value.strip()
    return token.strip(), options


def _scope(value: str, where: str) -> Scope:
    patterns = tuple(p.strip() for p in value.split(","))
    if not value or not all(_PATTERN.fullmatch(p) for p in patterns):
        raise TokenFileError(
            f"{where}: groups= takes group ids or patterns separated by commas (lowercase "
            "letters, digits, '.', '_', '-', and '*' or '?' as wildcards); omit groups= for "
            "an unscoped token"
        )
    return Scope(patterns)


def parse_line(line: str, where: str, default_name: str) -> tuple[bytes, Credential]:
    role, sep, rest = line.partition(":")
    role = role.strip()
    if not sep or role not in ROLES:
        raise TokenFileError(
            f"{where}: expected 'role:token' with role reader, worker or admin "
            "(then optionally ':name=NAME' and ':groups=PATTERNS')"
        )
    token, options = _options(rest, where)
    if not token:
        raise TokenFileError(f"{where}: expected 'role:token', the token is empty")
    if len(token) < MIN_TOKEN:
        raise TokenFileError(f"{where}: token shorter than {MIN_TOKEN} characters")
    name = options.get("name", default_name)
    if "name" in options and _NAME.fullmatch(name) is None:
        raise TokenFileError(
            f"{where}: name= takes 1 to 64 letters, digits, '.', '_' or '-' (got {name!r})"
        )
    scope = _scope(options["groups"], where) if "groups" in options else None
    if scope is not None and role != "worker":
        raise TokenFileError(
            f"{where}: groups= scopes worker tokens only (a {role} token is never scoped)"
        )
    digest = digest_of(token)
    return digest, Credential(role, name, scope, digest)  # type: ignore[arg-type]


def parse_tokens(text: str, *, source: str, inline: bool = False) -> Tokens:
    """A line each (``#`` comments); errors name the line, never the token."""
    tokens: Tokens = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word = "entry" if inline else "line"
        role = line.partition(":")[0].strip()
        default = f"inline-{role}#{number}" if inline else f"{role}#{number}"
        digest, credential = parse_line(line, f"{source} {word} {number}", default)
        tokens[digest] = credential
    return tokens


def inline_tokens(text: str) -> Tokens:
    """``REGISTRY_TOKENS``: entries separated by commas. A piece without ``:`` continues the
    ``groups=`` list of the entry before it (``worker:T:groups=a-*,b-*,reader:U``)."""
    entries: list[str] = []
    for piece in text.split(","):
        if entries and ":" not in piece and _OPTION.search(entries[-1]) is not None:
            last = entries[-1].rpartition(":")[2]
            if last.startswith("groups="):
                entries[-1] += "," + piece
                continue
        entries.append(piece)
    return parse_tokens("\n".join(entries), source="REGISTRY_TOKENS", inline=True)
