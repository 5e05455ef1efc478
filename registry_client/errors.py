"""Errors raised by the worker library.

Hierarchy::

    WorkersError
    ├── RegistryError                  anything that went wrong talking to the registry
    │   ├── RegistryUnavailable        no replica answered before the deadline (connection
    │   │                              errors or 503 on every try)
    │   └── ProblemError               the registry answered with problem+json (RFC 9457)
    │       ├── InvalidRequest         422 invalid_request
    │       ├── Unauthorized           401 unauthorized
    │       ├── Forbidden              403 forbidden
    │       ├── NotFound               404 not_found
    │       ├── GroupConflict          409 group_conflict
    │       ├── LaunchSuperseded       409 launch_superseded
    │       ├── EngineIdMismatch       409 engine_id_mismatch (.cause)
    │       ├── Incompatible           409 incompatible (.mismatches)
    │       ├── EngineSuperseded       410 engine_superseded (.current_engine_id)
    │       ├── PayloadTooLarge        413 payload_too_large
    │       ├── NotReady               503 not_ready (.missing_ranks)
    │       ├── StoreUnavailable       503 store_unavailable
    │       ├── RevisionCompacted      410 revision_compacted (list again)
    │       └── RevisionAhead          410 revision_ahead (list again)
    ├── EngineIdentityError            the TP group does not agree on its engine_id; raised
    │                                  on every rank with the same message
    ├── TransferError                  a NIXL transfer failed or missed its deadline
    └── VerificationError              bytes read do not match what the prefill wrote

The registry's `code` member is the stable key: `problem_from_response` picks the class from
it, so callers catch `EngineSuperseded`, never compare status numbers.
"""

from __future__ import annotations

from typing import Any, ClassVar


class WorkersError(Exception):
    """Base of every error this package raises on purpose."""


class RegistryError(WorkersError):
    """Talking to the registry failed."""


class RegistryUnavailable(RegistryError):
    """No registry replica gave a usable answer before the deadline."""

    def __init__(self, message: str, *, urls: list[str], attempts: int) -> None:
        super().__init__(message)
        self.urls = urls
        self.attempts = attempts


class ProblemError(RegistryError):
    """The registry answered with an RFC 9457 problem document."""

    code: ClassVar[str] = ""

    def __init__(self, problem: dict[str, Any], *, status: int, url: str = "") -> None:
        self.problem = problem
        self.status = status
        self.url = url
        self.title = str(problem.get("title", ""))
        self.detail = str(problem.get("detail", ""))
        self.problem_code = str(problem.get("code", self.code or "unknown"))
        super().__init__(f"{status} {self.problem_code}: {self.detail or self.title}")


class InvalidRequest(ProblemError):
    code = "invalid_request"

    @property
    def errors(self) -> list[Any]:
        value = self.problem.get("errors", [])
        return list(value) if isinstance(value, list) else []


class Unauthorized(ProblemError):
    code = "unauthorized"


class Forbidden(ProblemError):
    code = "forbidden"


class NotFound(ProblemError):
    code = "not_found"


class GroupConflict(ProblemError):
    code = "group_conflict"


class LaunchSuperseded(ProblemError):
    code = "launch_superseded"

    @property
    def current_generation(self) -> int | None:
        value = self.problem.get("current_generation")
        return int(value) if isinstance(value, int) else None


class EngineIdMismatch(ProblemError):
    code = "engine_id_mismatch"

    @property
    def cause(self) -> str:
        return str(self.problem.get("cause", "unknown"))

    @property
    def rank(self) -> int | None:
        """The rank refused (a batch names the first bad one)."""
        value = self.problem.get("rank")
        return int(value) if isinstance(value, int) else None

    @property
    def expected_engine_id(self) -> str | None:
        value = self.problem.get("expected_engine_id")
        return str(value) if value is not None else None

    @property
    def got_engine_id(self) -> str | None:
        value = self.problem.get("got_engine_id")
        return str(value) if value is not None else None


class Incompatible(ProblemError):
    code = "incompatible"

    @property
    def mismatches(self) -> list[dict[str, Any]]:
        value = self.problem.get("mismatches", [])
        return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


class EngineSuperseded(ProblemError):
    code = "engine_superseded"

    @property
    def current_engine_id(self) -> str | None:
        value = self.problem.get("current_engine_id")
        return str(value) if value is not None else None

    @property
    def current_generation(self) -> int | None:
        value = self.problem.get("current_generation")
        return int(value) if isinstance(value, int) else None


class PayloadTooLarge(ProblemError):
    code = "payload_too_large"


class NotReady(ProblemError):
    code = "not_ready"

    @property
    def missing_ranks(self) -> list[int]:
        value = self.problem.get("missing_ranks", [])
        return [int(r) for r in value] if isinstance(value, list) else []


class StoreUnavailable(ProblemError):
    code = "store_unavailable"


class RevisionCompacted(ProblemError):
    """A watch or a list page older than the history the registry keeps: list again."""

    code = "revision_compacted"

    @property
    def oldest_revision(self) -> int:
        return int(self.problem.get("oldest_revision", 0))


class RevisionAhead(ProblemError):
    """A watch or a list page from a revision beyond the store's (a store restored from a
    backup, or a registry restarted on a fresh file): list again."""

    code = "revision_ahead"


class TooManyWatchers(ProblemError):
    code = "too_many_watchers"


class WatchLost(RegistryUnavailable):
    """A watch heard nothing from any registry replica (no line, no bookmark, no answer)
    for its deadline: the registry is lost to this process."""


PROBLEM_CLASSES: dict[str, type[ProblemError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        GroupConflict,
        LaunchSuperseded,
        EngineIdMismatch,
        Incompatible,
        EngineSuperseded,
        PayloadTooLarge,
        NotReady,
        StoreUnavailable,
        RevisionCompacted,
        RevisionAhead,
        TooManyWatchers,
    )
}

# Used when an answer carries no (or an unknown) `code`: the status decides.
_STATUS_FALLBACK: dict[int, type[ProblemError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    410: EngineSuperseded,
    413: PayloadTooLarge,
    422: InvalidRequest,
}


def problem_class(status: int, problem: dict[str, Any]) -> type[ProblemError]:
    """The exception class for an error answer: by `code`, else by status."""
    cls = PROBLEM_CLASSES.get(str(problem.get("code", "")))
    if cls is not None:
        return cls
    return _STATUS_FALLBACK.get(status, ProblemError)


class EngineIdentityError(WorkersError):
    """The ranks of a TP group disagree about which engine they belong to.

    Raised on every rank of the group with the same message: `causes` maps each failing rank
    to a short cause key (`different_registry`, `different_group`, `superseded`,
    `registry_unreachable`, `open_failed`, `local_engine_id`), `details` to a sentence.
    """

    def __init__(self, message: str, *, causes: dict[int, str], details: dict[int, str]) -> None:
        super().__init__(message)
        self.causes = causes
        self.details = details


class TransferError(WorkersError):
    """A NIXL transfer failed, or did not finish before its deadline."""


class VerificationError(WorkersError):
    """Blocks read from a prefill engine are not the bytes it wrote."""
