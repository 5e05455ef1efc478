"""The embedded store: one SQLite file in WAL mode, emulating etcd's revisions and leases.

Writes run on one dedicated thread that owns the writing connection, so the event loop never
waits for a write lock or an fsync. Reads (``get``, ``range``) run on the event loop's thread
over a second connection: a WAL reader never waits for writers, and the hop to a thread would
cost more than the read (a third of a request's CPU). Should a read find the file busy anyway
(another process recovering the WAL, say), it is retried on the writer's thread, under the
store timeout. A write transaction is ``BEGIN IMMEDIATE`` … ``COMMIT``; once ``txn`` returns,
the change is in the WAL file, which survives a ``kill -9`` of the process (with
``synchronous=NORMAL``, the default; ``?synchronous=full`` also survives power loss, at one
fsync per write). Several processes may share the file; a busy database waits up to the store
timeout, then answers :class:`StoreUnavailable`.

Leases use this host's wall clock (``time.time``), the only clock the file's processes share,
so a lease outlives a restart of the service with its remaining time intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from app.errors import StoreUnavailable
from app.store.base import (
    Compare,
    Delete,
    Entry,
    Lease,
    Op,
    Put,
    Snapshot,
    Store,
    TxnResult,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY, ttl_s INTEGER NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, mod_revision INTEGER NOT NULL,
    lease INTEGER REFERENCES leases(id));
CREATE INDEX IF NOT EXISTS kv_lease ON kv(lease);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(expires_at);
INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('next_lease', 1);
"""

_LIVE = "(kv.lease IS NULL OR kv.lease IN (SELECT id FROM leases WHERE expires_at > ?))"


def _prefix_end(prefix: str) -> str:
    # Every key starting with ``prefix`` sorts in [prefix, prefix + U+10FFFF).
    return prefix + "\U0010ffff"


class SqliteStore(Store):
    def __init__(
        self,
        path: str | Path,
        *,
        timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        poll_interval_s: float = 0.25,
    ) -> None:
        self.path = str(path)
        self.description = f"sqlite:///{self.path}"
        self._timeout_s = timeout_s
        self._poll_interval_s = poll_interval_s
        # The thread that owns the connection, fed through a C-level queue: a call costs one
        # put and one call_soon_threadsafe, where run_in_executor costs a Python-level
        # Condition handshake and two chained futures (a visible share of a request's CPU).
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        # Reads on the event loop's thread; the lock only keeps two loops (tests) apart.
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self._synchronous = synchronous.upper()
        if self._synchronous not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be NORMAL, FULL or EXTRA, not {synchronous!r}")
        # Waiters: (prefix, future). Touched only on the event loop's thread.
        self._waiters: list[tuple[str, asyncio.Future[None]]] = []
        self._seen_revision = 0
        self._lock = threading.Lock()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self._timeout_s,
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
            conn.execute(f"PRAGMA busy_timeout={int(self._timeout_s * 1000)}")
            conn.execute("PRAGMA foreign_keys=OFF")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read-only ``fn`` here, on the loop's thread, when it needs no waiting."""
        if self._closed:
            raise StoreUnavailable("The SQLite store is closed (the service is shutting down).")
        # Until the writer has created the schema, and while another loop reads, take the
        # thread path; also when the file is busy (timeout=0 below: never wait here).
        if self._conn is not None and self._reader_lock.acquire(blocking=False):
            reader = self._reader
            try:
                if reader is None:
                    reader = self._reader = sqlite3.connect(
                        self.path, isolation_level=None, check_same_thread=False, timeout=0
                    )
                return fn(reader)
            except sqlite3.OperationalError:
                if reader is not None and reader.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        reader.execute("ROLLBACK")
            except sqlite3.Error as exc:
                raise StoreUnavailable(
                    f"SQLite store {self.path} failed: {exc}. "
                    "Check the file's disk and permissions."
                ) from exc
            finally:
                self._reader_lock.release()
        return await self._run(fn)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreUnavailable("The SQLite store is closed (the service is shutting down).")

        def call() -> T:
            with self._lock:
                conn = self._connect()
                return fn(conn)

        try:
            return await asyncio.wait_for(self._submit(call), self._timeout_s)
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"SQLite store {self.path} did not answer within {self._timeout_s:g} s "
                "(another process holding a write lock, or a stalled disk)."
            ) from exc
        except sqlite3.Error as exc:
            raise StoreUnavailable(
                f"SQLite store {self.path} failed: {exc}. Check the file's disk and permissions."
            ) from exc

    def _submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            # A daemon: a store nobody closed must not hold the interpreter at exit (an
            # interrupted write is then what a kill -9 leaves, which WAL recovers).
            self._thread = threading.Thread(target=self._work, name="sqlite-store", daemon=True)
            self._thread.start()
        self._queue.put((call, fut, loop))
        return fut

    def _work(self) -> None:
        """The connection's thread: run calls in order, hand each result to its loop."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, fut, loop = item
            try:
                outcome: tuple[Any, BaseException | None] = (call(), None)
            except BaseException as exc:  # handed to the awaiting coroutine
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, fut, *outcome)

    @staticmethod
    def _revision(conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT v FROM meta WHERE k='revision'").fetchone()
        return int(row[0])

    @staticmethod
    def _purge_expired(conn: sqlite3.Connection, now: float, revision: int) -> list[str]:
        """Delete expired leases and their keys inside the caller's write transaction."""
        keys = [
            r[0]
            for r in conn.execute(
                "SELECT key FROM kv WHERE lease IN (SELECT id FROM leases WHERE expires_at <= ?)",
                (now,),
            )
        ]
        if keys:
            conn.execute(
                "DELETE FROM kv WHERE lease IN (SELECT id FROM leases WHERE expires_at <= ?)",
                (now,),
            )
        conn.execute("DELETE FROM leases WHERE expires_at <= ?", (now,))
        return keys

    def _write(
        self, conn: sqlite3.Connection, body: Callable[[sqlite3.Connection, int], T]
    ) -> tuple[T, int, list[str]]:
        """Run ``body(conn, new_revision)`` in a write transaction; body returns its result."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            revision = self._revision(conn) + 1
            expired = self._purge_expired(conn, time.time(), revision)
            result = body(conn, revision)
            conn.execute("UPDATE meta SET v=? WHERE k='revision'", (revision,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return result, revision, expired

    def _notify(self, revision: int, changed: Sequence[str], prefixes: Sequence[str] = ()) -> None:
        self._seen_revision = max(self._seen_revision, revision)
        if not changed and not prefixes:
            return
        still: list[tuple[str, asyncio.Future[None]]] = []
        for prefix, fut in self._waiters:
            hit = any(k.startswith(prefix) for k in changed) or any(
                prefix.startswith(p) or p.startswith(prefix) for p in prefixes
            )
            if hit and not fut.done():
                fut.set_result(None)
            elif not fut.done():
                still.append((prefix, fut))
        self._waiters = still

    # -- reads -----------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        def fn(conn: sqlite3.Connection) -> Entry | None:
            row = conn.execute(
                f"SELECT key, value, mod_revision, lease FROM kv WHERE key=? AND {_LIVE}",
                (key, time.time()),
            ).fetchone()
            return None if row is None else Entry(row[0], bytes(row[1]), row[2], row[3])

        return await self._read(fn)

    async def range(self, prefix: str) -> Snapshot:
        def fn(conn: sqlite3.Connection) -> Snapshot:
            now = time.time()
            conn.execute("BEGIN")
            try:
                rows = conn.execute(
                    "SELECT kv.key, kv.value, kv.mod_revision, kv.lease, leases.expires_at "
                    "FROM kv LEFT JOIN leases ON kv.lease = leases.id "
                    "WHERE kv.key >= ? AND kv.key < ? "
                    "AND (kv.lease IS NULL OR leases.expires_at > ?) ORDER BY kv.key",
                    (prefix, _prefix_end(prefix), now),
                ).fetchall()
                revision = self._revision(conn)
            finally:
                conn.execute("COMMIT")
            entries = [Entry(r[0], bytes(r[1]), r[2], r[3]) for r in rows]
            remaining = {r[3]: r[4] - now for r in rows if r[3] is not None}
            return Snapshot(entries, revision, remaining, read_at=now)

        return await self._read(fn)

    # -- writes ----------------------------------------------------------------------------

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        def body(conn: sqlite3.Connection, revision: int) -> bool:
            now = time.time()
            for cmp in compares:
                row = conn.execute(
                    f"SELECT mod_revision FROM kv WHERE key=? AND {_LIVE}", (cmp.key, now)
                ).fetchone()
                if (row[0] if row else 0) != cmp.mod_revision:
                    raise _Rollback
            for op in ops:
                if isinstance(op, Put):
                    if op.lease is not None:
                        alive = conn.execute(
                            "SELECT 1 FROM leases WHERE id=? AND expires_at > ?", (op.lease, now)
                        ).fetchone()
                        if alive is None:
                            raise _Rollback
                    conn.execute(
                        "INSERT INTO kv(key, value, mod_revision, lease) VALUES (?,?,?,?) "
                        "ON CONFLICT(key) DO UPDATE SET value=excluded.value, "
                        "mod_revision=excluded.mod_revision, lease=excluded.lease",
                        (op.key, op.value, revision, op.lease),
                    )
                elif op.prefix:
                    conn.execute(
                        "DELETE FROM kv WHERE key >= ? AND key < ?",
                        (op.key, _prefix_end(op.key)),
                    )
                else:
                    conn.execute("DELETE FROM kv WHERE key=?", (op.key,))
            return True

        def fn(conn: sqlite3.Connection) -> tuple[bool, int, list[str]]:
            try:
                ok, revision, expired = self._write(conn, body)
            except _Rollback:
                return False, self._revision(conn), []
            return ok, revision, expired

        ok, revision, expired = await self._run(fn)
        changed = list(expired)
        prefixes: list[str] = []
        if ok:
            for op in ops:
                if isinstance(op, Delete) and op.prefix:
                    prefixes.append(op.key)
                else:
                    changed.append(op.key)
        self._notify(revision, changed, prefixes)
        return TxnResult(ok, revision)

    async def grant_lease(self, ttl_s: int) -> Lease:
        def body(conn: sqlite3.Connection, revision: int) -> int:
            lease_id = int(conn.execute("SELECT v FROM meta WHERE k='next_lease'").fetchone()[0])
            conn.execute("UPDATE meta SET v=? WHERE k='next_lease'", (lease_id + 1,))
            conn.execute(
                "INSERT INTO leases(id, ttl_s, expires_at) VALUES (?,?,?)",
                (lease_id, ttl_s, time.time() + ttl_s),
            )
            return lease_id

        lease_id, revision, expired = await self._run(lambda c: self._write(c, body))
        self._notify(revision, expired)
        return Lease(lease_id, ttl_s, float(ttl_s))

    async def refresh_lease(self, lease_id: int) -> Lease | None:
        def fn(conn: sqlite3.Connection) -> Lease | None:
            now = time.time()
            row = conn.execute(
                "SELECT ttl_s FROM leases WHERE id=? AND expires_at > ?", (lease_id, now)
            ).fetchone()
            if row is None:
                return None
            conn.execute("UPDATE leases SET expires_at=? WHERE id=?", (now + row[0], lease_id))
            return Lease(lease_id, int(row[0]), float(row[0]))

        return await self._run(fn)

    async def revoke_lease(self, lease_id: int) -> None:
        def body(conn: sqlite3.Connection, revision: int) -> list[str]:
            keys = [r[0] for r in conn.execute("SELECT key FROM kv WHERE lease=?", (lease_id,))]
            conn.execute("DELETE FROM kv WHERE lease=?", (lease_id,))
            conn.execute("DELETE FROM leases WHERE id=?", (lease_id,))
            return keys

        keys, revision, expired = await self._run(lambda c: self._write(c, body))
        self._notify(revision, keys + expired)

    async def purge_expired(self) -> int:
        """Delete expired leases' entries now (waking waiters); returns how many went."""

        def body(conn: sqlite3.Connection, revision: int) -> None:
            return None

        _, revision, expired = await self._run(lambda c: self._write(c, body))
        self._notify(revision, expired)
        return len(expired)

    # -- waiting ---------------------------------------------------------------------------

    async def wait(self, prefix: str, after_revision: int, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((prefix, fut))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_external_writes())
        # A change may have landed between the caller's read and this registration.
        snapshot = await self.range(prefix)
        if any(e.mod_revision > after_revision for e in snapshot.entries):
            fut.cancel()
            return True
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
            self._waiters = [(p, f) for p, f in self._waiters if f is not fut]

    async def _poll_external_writes(self) -> None:
        """Wake every waiter when another process wrote to the file (we can't tell what)."""
        while self._waiters and not self._closed:
            await asyncio.sleep(self._poll_interval_s)
            try:
                revision = await self._run(self._revision)
            except StoreUnavailable:
                continue
            if revision > self._seen_revision:
                self._seen_revision = revision
                self._notify(revision, [], [""])

    # -- lifecycle -------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._run(self._revision)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters = []
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

        def shut() -> None:
            with self._lock:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

        if self._thread is None:
            shut()
            return
        await self._submit(shut)
        self._queue.put(None)
        self._thread.join(timeout=5)


_Call = tuple[Callable[[], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the caller timed out (wait_for cancelled it)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class _Rollback(Exception):
    """A compare failed, or a Put named an expired lease: the transaction applies nothing."""
