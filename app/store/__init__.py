"""Store backends behind one interface; ``create_store`` picks one from a URL."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from app.store.base import Compare, Delete, Entry, Lease, Op, Put, Snapshot, Store, TxnResult

__all__ = [
    "Compare",
    "Delete",
    "Entry",
    "Lease",
    "Op",
    "Put",
    "Snapshot",
    "Store",
    "TxnResult",
    "check_store_url",
    "create_store",
]


def check_store_url(url: str) -> str:
    """Refuse a malformed store URL at configuration time, before anything starts."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        if parts.netloc or not parts.path.lstrip("/"):
            raise ValueError(
                f"Bad SQLite store URL {url!r}: use sqlite:///relative/path.db "
                "or sqlite:////absolute/path.db"
            )
        synchronous = parse_qs(parts.query).get("synchronous", ["normal"])[0]
        if synchronous.upper() not in {"NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"Bad SQLite store URL {url!r}: synchronous=normal|full|extra")
        return url
    if parts.scheme == "etcd":
        if not parts.netloc:
            raise ValueError(
                f"Bad etcd store URL {url!r}: use etcd://host:port[,host:port…]/prefix"
            )
        return url
    raise ValueError(
        f"Unknown store URL {url!r}: expected sqlite:///path/to/registry.db "
        "or etcd://host:port[,host:port…]/prefix"
    )


def create_store(url: str, *, timeout_s: float = 10.0, sweep_interval_s: float = 1.0) -> Store:
    """Build the store a URL names (``sqlite:///path`` or ``etcd://h:p[,h:p…]/prefix``).

    The etcd driver is imported only when an etcd URL is used, so the SQLite default needs
    nothing beyond the standard library.
    """
    parts = urlsplit(check_store_url(url))
    if parts.scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////abs/path.db, as SQLAlchemy spells them.
        path = parts.path[1:]
        query = parse_qs(parts.query)
        synchronous = query.get("synchronous", ["normal"])[0]
        from app.store.sqlite import SqliteStore

        return SqliteStore(
            path, timeout_s=timeout_s, synchronous=synchronous, sweep_interval_s=sweep_interval_s
        )
    if parts.scheme == "etcd":
        try:
            from app.store.etcd import EtcdStore
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ValueError(
                f"The etcd store needs its client library: pip install 'engine-registry[etcd]' "
                f"({exc})"
            ) from exc
        return EtcdStore.from_url(url, timeout_s=timeout_s)
    raise AssertionError("unreachable: check_store_url admits sqlite and etcd only")
