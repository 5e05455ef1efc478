"""The WAL's checkpoints, on a thread and a connection of their own.

A commit appends its pages to the WAL; a checkpoint copies them into the database file and
syncs it. SQLite runs one by itself inside the ``COMMIT`` that takes the WAL past
``wal_autocheckpoint`` pages, so every such commit (and every request waiting on it) waited
for about 4 MiB to be copied and synced: in a launch, a 10-50 ms stall of the whole group
commit every 70-odd groups. Here the writer's connection leaves that to this thread, woken
once ``EVERY_BYTES`` of values were committed since the last checkpoint, which runs a
``PASSIVE`` checkpoint (it takes no lock a commit needs: commits go on meanwhile).

Nothing about durability changes: a commit is answered once it is in the WAL, as before, and a
checkpoint only moves what is already there. The writer keeps a backstop
(``BACKSTOP_PAGES``): if this thread falls behind or fails, the WAL stops growing where SQLite
checkpoints it inside a commit again. The connection is opened read-write without create
(``mode=rw``) at the first checkpoint and kept: it never makes a file where the store's was
deleted, and follows no file put in its place.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import urllib.parse

log = logging.getLogger("app.store")

EVERY_BYTES = 4 << 20  # about wal_autocheckpoint's default (1,000 pages of 4 KiB)
BACKSTOP_PAGES = 8000  # the writer's own wal_autocheckpoint: 8 times the usual WAL


class Checkpointer:
    def __init__(self, path: str, timeout_s: float, every_bytes: int = EVERY_BYTES) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.every_bytes = every_bytes
        self.checkpoints = 0
        self._written = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` more were committed (called on the file's thread after a commit)."""
        self._written += nbytes
        if self._written < self.every_bytes or self._stopping:
            return
        self._written = 0
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                break
            try:
                if self._conn is None:
                    uri = f"file:{urllib.parse.quote(self.path)}?mode=rw"
                    self._conn = sqlite3.connect(
                        uri,
                        uri=True,
                        isolation_level=None,
                        check_same_thread=False,
                        timeout=self.timeout_s,
                    )
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.checkpoints += 1
            except sqlite3.Error as exc:  # the writer's backstop checkpoints meanwhile
                log.warning("SQLite checkpoint failed", extra={"error": str(exc)})
                self._close_connection()
        self._close_connection()

    def _close_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def stop(self) -> None:
        """End the thread (after a checkpoint under way) and close its connection, so that the
        writer's connection is the last one and its close checkpoints the WAL away."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
            self._thread = None
        self._stopping = False
