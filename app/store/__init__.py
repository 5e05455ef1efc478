"""Store backends behind one interface; ``create_store`` picks one from a URL.

The URL's scheme names the backend (``_BACKENDS``); each backend's module parses and checks
its own URLs and builds its store, and is imported only when its scheme is used, so the
SQLite default needs nothing beyond the standard library (as torch's rendezvous handlers
are registered by name and imported on use).
"""

from __future__ import annotations

import importlib

from app.store.base import (
    Backend,
    ChangeBatch,
    Compacted,
    Compare,
    Delete,
    Entry,
    KeyChange,
    Lease,
    Op,
    Put,
    Snapshot,
    Store,
    StoreOptions,
    TooLarge,
    TxnResult,
    Unavailable,
)
from app.store.etcd.config import EtcdAccess, redact

__all__ = [
    "ChangeBatch",
    "Compacted",
    "Compare",
    "Delete",
    "Entry",
    "EtcdAccess",
    "KeyChange",
    "Lease",
    "Op",
    "Put",
    "Snapshot",
    "Store",
    "StoreOptions",
    "TooLarge",
    "TxnResult",
    "Unavailable",
    "check_store_url",
    "create_store",
]

# scheme → the module whose BACKEND parses its URLs and opens its stores.
_BACKENDS = {
    "sqlite": "app.store.sqlite",
    "etcd": "app.store.etcd",
    "etcds": "app.store.etcd",
}
_EXPECTED = (
    "expected sqlite:///path/to/registry.db, etcd://host:port[,host:port…]/prefix "
    "or etcds://host:port[,host:port…]/prefix (TLS)"
)


def backend(url: str) -> Backend:
    """The backend that serves ``url``, by its scheme."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    module = _BACKENDS.get(scheme)
    if module is None:
        raise ValueError(f"Unknown store URL {redact(url)!r}: {_EXPECTED}")
    found: Backend = importlib.import_module(module).BACKEND
    return found


def check_store_url(url: str) -> str:
    """Refuse a malformed store URL at configuration time, before anything starts."""
    backend(url).check_url(url)
    return url


def create_store(
    url: str,
    *,
    timeout_s: float = 10.0,
    sweep_interval_s: float = 1.0,
    etcd: EtcdAccess | None = None,
    history: int = 10_000,
) -> Store:
    """Build the store a URL names (``sqlite:///path``, ``etcd[s]://h:p[,h:p…]/prefix``);
    ``etcd``: TLS files and credentials for an ``etcds://`` store; ``history``: revisions of
    changes a SQLite store keeps for watches (etcd keeps its own)."""
    options = StoreOptions(
        timeout_s=timeout_s, sweep_interval_s=sweep_interval_s, access=etcd, history=history
    )
    found = backend(url)
    found.check_url(url)
    return found.open(url, options)
