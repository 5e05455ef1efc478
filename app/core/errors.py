"""Errors of the registry, each one an RFC 9457 problem with a stable ``code``.

    RegistryError                      the base; carries status, code, title, detail, extras
    ├── HttpProblem           4xx/500  method_not_allowed, internal (outside the contract)
    ├── InvalidRequest        422      invalid_request (``errors``: the field errors)
    ├── Unauthorized          401      unauthorized
    ├── Forbidden             403      forbidden
    ├── NotFound              404      not_found
    ├── PayloadTooLarge       413      payload_too_large
    ├── GroupConflict         409      group_conflict
    ├── LaunchSuperseded      409      launch_superseded (current_generation)
    ├── EngineIdMismatch      409      engine_id_mismatch (expected/got_engine_id, cause)
    ├── Incompatible          409      incompatible (mismatches)
    ├── EngineSuperseded      410      engine_superseded (current_engine_id, current_generation)
    ├── RevisionCompacted     410      revision_compacted (oldest_revision)
    ├── RevisionAhead         410      revision_ahead (store_revision)
    ├── TooManyWatchers       503      too_many_watchers
    ├── ShuttingDown          503      shutting_down
    ├── NotReady              503      not_ready (missing_ranks)
    └── StoreUnavailable      503      store_unavailable

The HTTP server itself (``app/server/serve.py``) answers a few problems before the app sees a
request: 400 bad_http_request, 408 request_timeout, 431 headers_too_large and 503
too_many_connections.

Store backends translate their driver's errors at their boundary into the storage-level
``app.store.Unavailable`` (``raise Unavailable(...) from exc``): nothing backend-specific,
and nothing of HTTP, leaves the store. The edge (FastAPI's handlers, the fast path) answers
it as ``StoreUnavailable``, which is itself an ``Unavailable``, so code that retries or
degrades catches one class whether the store or the domain gave up.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from app.store.base import TooLarge, Unavailable

PROBLEM_TYPE_BASE = "urn:engine-registry:problem:"


class RegistryError(Exception):
    status: int = 500
    code: str = "internal"
    title: str = "Internal error"

    def __init__(self, detail: str, **extras: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extras = extras

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": PROBLEM_TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if instance is not None:
            body["instance"] = instance
        body.update(self.extras)
        return body


class HttpProblem(RegistryError):
    """An HTTP-level error outside the contract's table (wrong method, unexpected failure)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code = status, code
        self.title = code.replace("_", " ").capitalize()


FieldPath = tuple[str | int, ...]


@dataclass(frozen=True)
class FieldProblem:
    """What is wrong with one input field, named as the domain knows it (``("rank",)``,
    ``("agents", 3, "host")``). Where the field came from (the path or the body) is the HTTP
    edge's knowledge: it adds that when it answers (:meth:`InvalidRequest.locate`)."""

    field: FieldPath
    msg: str
    type: str


class InvalidRequest(RegistryError):
    status = 422
    code = "invalid_request"
    title = "Invalid request"

    def __init__(self, detail: str, *, fields: Sequence[FieldProblem] = (), **extras: Any) -> None:
        super().__init__(detail, **extras)
        self.fields = list(fields)

    def locate(self, path_params: Collection[str]) -> None:
        """The ``errors`` list of the answer: each field under ``path`` when the route takes it
        in its path, else under ``body`` (errors the HTTP layer gave itself stay as given)."""
        if self.fields and "errors" not in self.extras:
            self.extras["errors"] = [
                {
                    "loc": ["path" if f.field[0] in path_params else "body", *f.field],
                    "msg": f.msg,
                    "type": f.type,
                }
                for f in self.fields
            ]


class Unauthorized(RegistryError):
    status = 401
    code = "unauthorized"
    title = "Authentication required"


class Forbidden(RegistryError):
    status = 403
    code = "forbidden"
    title = "Not allowed for this token's role"


class NotFound(RegistryError):
    status = 404
    code = "not_found"
    title = "Not found"


class PayloadTooLarge(RegistryError):
    status = 413
    code = "payload_too_large"
    title = "Request body too large"


class GroupConflict(RegistryError):
    status = 409
    code = "group_conflict"
    title = "Launch conflicts with the group's current engine"


class LaunchSuperseded(RegistryError):
    status = 409
    code = "launch_superseded"
    title = "This launch was superseded by a newer one"


class EngineIdMismatch(RegistryError):
    status = 409
    code = "engine_id_mismatch"
    title = "engine_id is not the group's current engine"


class Incompatible(RegistryError):
    status = 409
    code = "incompatible"
    title = "Prefill and decode engines are incompatible"


class EngineSuperseded(RegistryError):
    status = 410
    code = "engine_superseded"
    title = "Engine superseded by a newer generation"


class RevisionCompacted(RegistryError):
    status = 410
    code = "revision_compacted"
    title = "The revision is older than the history this registry keeps"


class RevisionAhead(RegistryError):
    """A watch's or continue token's revision beyond the store's: the store was restored
    from a backup or replaced; the client lists again (as after ``revision_compacted``)."""

    status = 410
    code = "revision_ahead"
    title = "The revision is ahead of the store's"


class TooManyWatchers(RegistryError):
    status = 503
    code = "too_many_watchers"
    title = "This replica serves as many watches as it may"


class ShuttingDown(RegistryError):
    """SIGTERM: a new watch on a draining replica (`app.server.shutdown`)."""

    status = 503
    code = "shutting_down"
    title = "This replica is shutting down"


class NotReady(RegistryError):
    status = 503
    code = "not_ready"
    title = "Target ranks have no live agent"


class StoreUnavailable(RegistryError, Unavailable):
    status = 503
    code = "store_unavailable"
    title = "The registry's store does not answer"


class Overloaded(RegistryError):
    """A read that can wait, shed while the registry is saturated (app/server/shedding.py)."""

    status = 503
    code = "overloaded"
    title = "The registry is saturated; retry after Retry-After seconds"


def at_edge(error: RegistryError | Unavailable) -> RegistryError:
    """The problem to answer: a registry error as it is, a store's ``Unavailable`` as 503."""
    if isinstance(error, RegistryError):
        return error
    if isinstance(error, TooLarge):
        return PayloadTooLarge(str(error))
    return StoreUnavailable(str(error))
