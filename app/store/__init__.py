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
    "create_store",
]


def create_store(url: str, *, timeout_s: float = 10.0) -> Store:
    """Build the store a URL names (``sqlite:///path`` or ``etcd://h:p[,h:p…]/prefix``).

    The etcd driver is imported only when an etcd URL is used, so the SQLite default needs
    nothing beyond the standard library.
    """
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////abs/path.db, as SQLAlchemy spells them.
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        if parts.netloc or not path:
            raise ValueError(
                f"Bad SQLite store URL {url!r}: use sqlite:///relative/path.db "
                "or sqlite:////absolute/path.db"
            )
        query = parse_qs(parts.query)
        synchronous = query.get("synchronous", ["normal"])[0]
        from app.store.sqlite import SqliteStore

        return SqliteStore(path, timeout_s=timeout_s, synchronous=synchronous)
    if parts.scheme == "etcd":
        try:
            from app.store.etcd import EtcdStore
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ValueError(
                f"The etcd store needs its client library: pip install 'engine-registry[etcd]' "
                f"({exc})"
            ) from exc
        return EtcdStore.from_url(url, timeout_s=timeout_s)
    raise ValueError(
        f"Unknown store URL {url!r}: expected sqlite:///path/to/registry.db "
        "or etcd://host:port[,host:port…]/prefix"
    )
