"""The SQLite file behind the embedded store: its schema, loading it whole, and committing
batches of changes on the one thread that owns the connection.

The store (``app.store.sqlite.store``) keeps every entry and lease in memory and decides every
transaction there; this module only makes those decisions durable. A batch of changes from
many requests is written in one ``BEGIN IMMEDIATE`` … ``COMMIT`` (group commit): once it
returns, the changes are in the WAL file, which survives a ``kill -9`` (``synchronous=NORMAL``;
``FULL`` also survives power loss, at one fsync per batch). The WAL is copied into the file
by a thread of its own (``app.store.sqlite.checkpoint``), not inside a commit.

Failures are classified here so that the operator reads the cause, not SQLite's last words:
a full disk, a read-only file system, a file deleted or replaced under the running process,
another process holding the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.store.base import Entry
from app.store.sqlite.checkpoint import BACKSTOP_PAGES, Checkpointer

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY, ttl_s INTEGER NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, mod_revision INTEGER NOT NULL,
    lease INTEGER REFERENCES leases(id));
CREATE INDEX IF NOT EXISTS kv_lease ON kv(lease);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(expires_at);
INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('next_lease', 1), ('probe', 0);
"""


class FileFailure(Exception):
    """The file cannot be written (or read); ``detail`` names the cause and the fix.
    ``permanent``: retrying cannot help (the file was deleted or replaced)."""

    def __init__(self, detail: str, *, permanent: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.permanent = permanent


class FileLocked(Exception):
    """Another process serves this file: the in-memory state would go stale."""


@dataclass(slots=True)
class Change:
    """What one store operation changed, decided in memory, to be made durable."""

    revision: int
    next_lease: int
    puts: list[Entry] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    lease_puts: list[tuple[int, int, float]] = field(default_factory=list)  # id, ttl, expiry
    lease_deletes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Loaded:
    entries: list[Entry]
    leases: dict[int, tuple[int, float]]  # id -> (ttl_s, expires_at)
    revision: int
    next_lease: int


def classify(path: str, exc: BaseException) -> FileFailure:
    """A driver error as a failure an operator can act on."""
    text = str(exc)
    low = text.lower()
    directory = os.path.dirname(os.path.abspath(path))
    if "full" in low:
        why = f"the disk is full (free space on {directory})"
    elif "readonly" in low or "read-only" in low:
        why = f"the file system or file is read-only (make {directory} writable)"
    elif "disk i/o" in low or "ioerr" in low:
        why = f"a disk I/O error (check the device behind {directory} and the kernel log)"
    elif "unable to open" in low:
        why = f"the file cannot be opened (check {directory} exists and its permissions)"
    else:
        why = "check the file's disk and permissions"
    return FileFailure(f"SQLite store {path} failed: {text}: {why}.")


class SqliteFile:
    """The connection and the file's identity. Every method runs on the store's thread."""

    def __init__(self, path: str, *, synchronous: str, timeout_s: float) -> None:
        self.path = path
        self.synchronous = synchronous
        self.timeout_s = timeout_s
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self.checkpointer = Checkpointer(path, timeout_s)

    # -- opening ---------------------------------------------------------------------------

    def _lock(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileLocked(
                f"Another process serves the SQLite store {self.path}: the embedded store is "
                "owned by one registry process. Stop the other one, give this one its own "
                "file, or run replicas on etcd (REGISTRY_STORE=etcd://…)."
            ) from None
        self._lock_fd = fd

    def load(self) -> Loaded:
        """(Re)open the file and read everything in it."""
        self.close_connection()
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self.timeout_s,
                cached_statements=CACHED_STATEMENTS,
            )
        except (sqlite3.Error, OSError) as exc:
            raise classify(self.path, exc) from exc
        try:
            stat = os.stat(self.path)
            if self._identity is not None and self._identity != (stat.st_dev, stat.st_ino):
                raise FileFailure(self._replaced_detail(), permanent=True)
            self._lock()
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            # The WAL is checkpointed by the checkpoint thread; SQLite's own only past this.
            conn.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
            conn.executescript(_SCHEMA)
            conn.execute("BEGIN")
            try:
                meta = dict(conn.execute("SELECT k, v FROM meta").fetchall())
                leases = {
                    int(r[0]): (int(r[1]), float(r[2]))
                    for r in conn.execute("SELECT id, ttl_s, expires_at FROM leases")
                }
                entries = [
                    Entry(r[0], bytes(r[1]), int(r[2]), r[3])
                    for r in conn.execute(
                        "SELECT key, value, mod_revision, lease FROM kv ORDER BY key"
                    )
                ]
            finally:
                conn.execute("COMMIT")
        except FileFailure:
            conn.close()
            raise
        except FileLocked:
            conn.close()
            raise
        except (sqlite3.Error, OSError) as exc:
            conn.close()
            raise classify(self.path, exc) from exc
        self._conn = conn
        self._identity = (stat.st_dev, stat.st_ino)
        return Loaded(entries, leases, int(meta["revision"]), int(meta["next_lease"]))

    def _replaced_detail(self) -> str:
        return (
            f"SQLite store {self.path} was deleted or replaced under the running registry: "
            "writes are refused so that nothing more is lost. Everything since the last "
            "backup lives only in this process now; restore the file, or restart the "
            "registry (on an empty file) and relaunch the groups."
        )

    def check_identity(self) -> None:
        """Raise a permanent failure when the file we opened is no longer at ``path``."""
        if self._identity is None:
            return
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            raise FileFailure(self._replaced_detail(), permanent=True) from None
        except OSError:
            return  # a stalled or vanished mount: the commit itself will say what failed
        if (stat.st_dev, stat.st_ino) != self._identity:
            raise FileFailure(self._replaced_detail(), permanent=True)

    # -- writing ---------------------------------------------------------------------------

    def commit(self, changes: list[Change]) -> None:
        """Write every change in one transaction, or none of them.

        The batch is first reduced to each key's and each lease's last state (one
        transaction: what lies between is never seen), then written with a few multi-row
        statements. The connection's thread gives up the GIL around every statement SQLite
        steps, and must win it back from the busy event loop each time: a statement per row
        would make a batch of a thousand rows a thousand such hand-overs."""
        kv: dict[str, Entry | None] = {}
        leases: dict[int, tuple[int, int, float] | None] = {}
        for change in changes:  # in order, each change's parts in the order they apply
            for lease in change.lease_puts:
                leases[lease[0]] = lease
            for key in change.deletes:
                kv[key] = None
            for entry in change.puts:
                kv[entry.key] = entry
            for lease_id in change.lease_deletes:
                leases[lease_id] = None
        last = changes[-1]

        def write(conn: sqlite3.Connection) -> None:
            # Leases before the keys on them, and dropped after them (kv.lease references it).
            _rows(conn, _PUT_LEASE, [lease for lease in leases.values() if lease is not None])
            _rows(conn, _DELETE_KV, [(k,) for k, e in kv.items() if e is None])
            _rows(
                conn,
                _PUT_KV,
                [(e.key, e.value, e.mod_revision, e.lease) for e in kv.values() if e is not None],
            )
            _rows(conn, _DELETE_LEASE, [(i,) for i, lease in leases.items() if lease is None])
            conn.execute(_PUT_META, (last.revision, last.next_lease))

        self._transaction(write)
        self.checkpointer.wrote(sum(len(e.value) + _ROW_BYTES for e in kv.values() if e))

    def probe(self) -> None:
        """A real write, so that readiness fails when writes would (full or frozen disk)."""
        self._transaction(lambda conn: conn.execute("UPDATE meta SET v=v+1 WHERE k='probe'"))

    def _transaction(self, write: Callable[[sqlite3.Connection], object]) -> None:
        """``BEGIN IMMEDIATE``, ``write``, ``COMMIT``; on a driver error, roll back, close the
        connection (the next load reopens it: that recovers a remount, say) and raise the
        failure classified."""
        self.check_identity()
        conn = self._conn
        if conn is None:
            raise FileFailure(f"SQLite store {self.path} is not open.")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                write(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            failure = classify(self.path, exc)
            self.close_connection()
            raise failure from exc

    # -- closing ---------------------------------------------------------------------------

    def close_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.checkpointer.stop()
        self.close_connection()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# Multi-row statements of at most _CHUNK rows (4,096 parameters). Each statement is a hand-over
# of the GIL (the thread waits for the busy event loop to let go of it, up to the interpreter's
# switch interval, 5 ms), so a batch's rows of one kind go in as few statements as possible: a
# batch of n rows is one statement of n rows padded (``_padded``) to one of a few sizes with
# copies of its last row, which change nothing (a key put or deleted twice in one statement is
# put or deleted once), so that few distinct statements exist for the connection's cache.
_DELETE_KV = ("DELETE FROM kv WHERE key IN ({})", "?")
_PUT_KV = ("INSERT OR REPLACE INTO kv(key, value, mod_revision, lease) VALUES {}", "(?,?,?,?)")
_PUT_LEASE = ("INSERT OR REPLACE INTO leases(id, ttl_s, expires_at) VALUES {}", "(?,?,?)")
_DELETE_LEASE = ("DELETE FROM leases WHERE id IN ({})", "?")
_PUT_META = (
    "UPDATE meta SET v = CASE k WHEN 'revision' THEN ? ELSE ? END "
    "WHERE k IN ('revision', 'next_lease')"
)
_CHUNK = 1024
_ROW_BYTES = 64  # a row's key, revision, lease and b-tree cell, about, beside its value
# The connection's prepared statements kept: 4 kinds of rows, 64 sizes each (``_padded``).
CACHED_STATEMENTS = 512


def _padded(n: int) -> int:
    """The statement size for ``n`` rows (1 <= n <= _CHUNK): n itself up to 16, else n rounded
    up to an eighth of its power of two (at most 12.5% more rows; 64 sizes up to 1,024)."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _rows(
    conn: sqlite3.Connection, statement: tuple[str, str], rows: list[tuple[object, ...]]
) -> None:
    template, one = statement
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        size = _padded(len(chunk))
        chunk += [chunk[-1]] * (size - len(chunk))
        conn.execute(template.format(",".join([one] * size)), [v for row in chunk for v in row])
