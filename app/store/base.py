"""The storage interface: a small key-value store with multi-key compare-and-set and leases.

It is shaped after etcd's data model, so that the etcd backend is a thin translation and the
SQLite backend a faithful emulation:

- every write bumps one store-wide ``revision``; every entry carries the revision of its last
  write (``mod_revision``);
- a transaction compares entries' mod_revisions (0 = "must be absent") and, only if all
  match, applies its operations atomically. Losing a race is a return value, not an exception;
- an entry may be attached to a lease, which expires ``ttl_s`` seconds after its last refresh
  unless refreshed; an expired lease's entries are gone for every reader;
- ``wait`` blocks (with a deadline) until something under a prefix changes after a revision.

Every method raises :class:`Unavailable` when the backend does not answer
within the operator's bound, and never anything backend-specific.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field


class Unavailable(Exception):
    """The store cannot answer now, within its deadline (a stalled or full disk, a lost etcd
    quorum, a refused connection): the caller may retry later. A storage-level error, with
    nothing of HTTP in it; the service's edge answers it as ``503 store_unavailable``
    (``app.core.errors.StoreUnavailable``). Its message names the cause and the fix."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class TooLarge(Unavailable):
    """The store refuses this request for its size, and always will (etcd's
    ``--max-request-bytes``): retrying cannot help, so it is raised at once, never retried.
    The service's edge answers it as ``413 payload_too_large``."""


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int
    lease: int | None = None


@dataclass(frozen=True, slots=True)
class Compare:
    """Holds when ``key``'s mod_revision equals ``mod_revision`` (0: the key is absent)."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """Deletes ``key``, or every key starting with it when ``prefix`` is set."""

    key: str
    prefix: bool = False


Op = Put | Delete


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int
    # Seconds until expiry as the store sees it (not a wall-clock instant: clocks differ).
    remaining_s: float
    # A renewal's: the store revision at which it was applied, where the store says (etcd);
    # the state at any revision from it on is no older than the renewal.
    revision: int | None = None
    # That revision is a write the registry's watch sees (the etcd renewal journal's): the
    # watch reaches it without asking the store for its progress.
    watched: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Entries under a prefix, read at one consistent ``revision``."""

    entries: list[Entry]
    revision: int
    # Remaining lease time of each lease those entries hold, read with them.
    lease_remaining_s: dict[int, float]
    # This host's wall-clock time at which ``lease_remaining_s`` was measured, so that every
    # reader of one snapshot derives the same expiry instants from it.
    read_at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class KeyChange:
    """One key's change: its new ``entry``, or None when it was deleted (or its lease
    expired)."""

    key: str
    entry: Entry | None


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    """The changes under a watched prefix at one ``revision``, in key order of the write.
    Empty ``changes``: progress, every change up to ``revision`` has been delivered."""

    revision: int
    changes: tuple[KeyChange, ...]


class Compacted(Exception):
    """The store no longer keeps the changes a watch asked for: ``oldest`` is the oldest
    revision a watch may start at (read again, then watch from after the read's revision)."""

    def __init__(self, oldest: int) -> None:
        super().__init__(f"history before revision {oldest} is compacted")
        self.oldest = oldest


class Store(ABC):
    """A key-value store with compare-and-set transactions and leases (see module doc)."""

    #: A short description for logs and /readyz, never including credentials.
    description: str = ""
    #: Whether :meth:`refresh_lease` answers with the revision the renewal was applied at.
    renewal_revisions: bool = False
    #: Whether a read is a round trip to a server (etcd: a linearizable read, which waits for
    #: the leader and for the member to apply the writes before it). The registry then decides
    #: a write on its watch feed where the write's own compares make that decision safe, and
    #: reads the store only when they fail.
    remote_reads: bool = False
    #: Told, when the store ends leases because their time ran out (never for a revoke), the
    #: entries that went with them, at that moment (the registry records ``lease_expired``).
    on_expired: Callable[[list[Entry]], None] | None = None

    @abstractmethod
    async def get(self, key: str, *, settled: bool = True) -> Entry | None:
        """The live entry at ``key``; ``settled`` as for :meth:`range`."""

    @abstractmethod
    async def range(self, prefix: str, *, settled: bool = True) -> Snapshot:
        """Every live entry whose key starts with ``prefix``, ordered by key.

        ``settled=False`` may include changes still on their way to durable storage (the
        SQLite store's group commit): only for a writer that decides on them and answers
        after its own commit, which lands after theirs and fails with them. A store whose
        reads are always durable (etcd) ignores it."""

    def peek(self, keys: Sequence[str]) -> list[Entry | None] | None:
        """The live entries at ``keys`` read now, without waiting, when the store holds them in
        memory and none has a change on its way (None: read them with :meth:`get`)."""
        return None

    def memory_version(self, segment: str) -> int | None:
        """A number that changes with every change to the entries :meth:`peek` reads under
        ``segment/`` (a put, a delete, a lease's end, a reload), so an equal number says a
        peek there would find the same entries, save those whose lease has ended since; None
        where :meth:`peek` cannot answer now. Per top segment: the events a registry appends
        (``events/``) never stand for a change to its groups (``groups/``)."""
        return None

    @abstractmethod
    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        """Apply ``ops`` atomically if every compare holds; else change nothing."""

    @abstractmethod
    async def grant_lease(self, ttl_s: int) -> Lease: ...

    @abstractmethod
    async def refresh_lease(self, lease_id: int) -> Lease | None:
        """Restart the lease's countdown; None when it expired or never existed."""

    @abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """End the lease now, deleting its entries; a no-op for an unknown lease."""

    @abstractmethod
    async def wait(self, prefix: str, after_revision: int, timeout_s: float) -> bool:
        """Return True once a key under ``prefix`` changed after ``after_revision``,
        False when ``timeout_s`` passed first. May return True spuriously."""

    async def entries(self, prefix: str) -> Snapshot:
        """``range`` without the leases' time left (a follower of changes needs none)."""
        return await self.range(prefix)

    async def lease_remaining(self, leases: set[int]) -> dict[int, float]:
        """Seconds each lease has left (0 or less: expired), as ``range`` reports them."""
        return {}

    async def revision(self) -> int:
        """The store's current revision (a linearizable read of nothing)."""
        return (await self.range("\x7frevision/")).revision

    @abstractmethod
    def changes(
        self,
        prefix: str,
        start_revision: int,
        progress_s: float,
        nudge: asyncio.Event | None = None,
    ) -> AsyncIterator[ChangeBatch]:
        """Every change under ``prefix`` at ``start_revision`` and after, one batch per
        revision in revision order, with an empty batch (progress) at least every
        ``progress_s`` when nothing changes, and soon after ``nudge`` is set. Raises
        :class:`Compacted` when the history from ``start_revision`` is gone (at the start or
        later), :class:`Unavailable` when the stream breaks: the caller opens it again after
        the last revision it got."""

    async def start(self) -> None:  # noqa: B027 - optional hook, most backends are lazy
        """Connect and start the backend's own background work; lazy backends need not."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise Unavailable unless the store answers a trivial read."""

    @abstractmethod
    async def close(self) -> None: ...


@dataclass(frozen=True)
class StoreOptions:
    """What the service's settings tell a backend beyond its URL."""

    timeout_s: float = 10.0
    sweep_interval_s: float = 1.0  # SQLite: how often expired leases are purged
    # A backend's own access settings, which this interface does not name (etcd: TLS files and
    # credentials, an `app.store.etcd.config.EtcdAccess`; the backend checks the type).
    access: object = None
    history: int = 10_000  # SQLite: revisions of changes kept for watches


@dataclass(frozen=True)
class Backend:
    """A store backend as the URL table (``app.store``) knows it: ``check_url`` refuses a
    malformed URL with a message naming the fix, without connecting or importing a driver;
    ``open`` builds the store (lazy: it connects on ``start`` or first use)."""

    check_url: Callable[[str], None]
    open: Callable[[str, StoreOptions], Store]
