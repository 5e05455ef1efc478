"""The etcd store: the storage interface on an etcd v3 cluster.

The backend (``BACKEND``: the URL's check, and the store's opening) is here; the client
library is imported only when a store opens."""

from __future__ import annotations

from app.store.base import Backend, Store, StoreOptions
from app.store.etcd.config import EtcdAccess, parse_url


def check_url(url: str) -> None:
    parse_url(url)


def open_store(url: str, options: StoreOptions) -> Store:
    try:
        from app.store.etcd.store import EtcdStore
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(
            f"The etcd store needs its client library: pip install 'engine-registry[etcd]' ({exc})"
        ) from exc
    access = options.access
    if access is not None and not isinstance(access, EtcdAccess):
        raise TypeError(f"the etcd store's access settings are an EtcdAccess, not {access!r}")
    return EtcdStore.from_url(url, timeout_s=options.timeout_s, access=access)


BACKEND = Backend(check_url, open_store)
