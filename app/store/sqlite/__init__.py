"""The embedded store: every entry and lease in memory, made durable in one SQLite file.

The backend (``BACKEND``: the URL's check, and the store's opening) is here."""

from __future__ import annotations

from app.store.base import Backend, Store, StoreOptions
from app.store.sqlite.url import parse_url


def check_url(url: str) -> None:
    parse_url(url)


def open_store(url: str, options: StoreOptions) -> Store:
    from app.store.sqlite.store import SqliteStore

    path, synchronous = parse_url(url)
    return SqliteStore(
        path,
        timeout_s=options.timeout_s,
        synchronous=synchronous,
        sweep_interval_s=options.sweep_interval_s,
        history=options.history,
    )


BACKEND = Backend(check_url, open_store)
