"""The etcd store: the storage interface on an etcd v3 cluster.

The backend (``BACKEND``: the URL's check, and the store's opening) is here; the client
library is imported only when a store opens."""

from __future__ import annotations

import importlib.util

from app.store.base import Backend, Store, StoreOptions
from app.store.etcd.config import EtcdAccess, parse_url

# The package is not on an index: its extra installs from the checkout.
INSTALL = "from the checkout: .venv/bin/pip install -e '.[etcd]'"
_CLIENT = ("aetcd", "grpc")  # pyproject's etcd extra


def check_url(url: str) -> None:
    """The URL, and the client library it needs: a missing one stops the start in one line
    (configuration time, before anything serves) instead of a traceback from the lifespan."""
    parse_url(url)
    missing = [name for name in _CLIENT if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"the etcd store needs its client library ({', '.join(missing)} not installed); "
            f"install it {INSTALL}"
        )


def open_store(url: str, options: StoreOptions) -> Store:
    try:
        from app.store.etcd.store import EtcdStore
    except ImportError as exc:  # pragma: no cover - check_url said so at configuration
        raise ValueError(f"the etcd store needs its client library ({exc}); {INSTALL}") from None
    access = options.access
    if access is not None and not isinstance(access, EtcdAccess):
        raise TypeError(f"the etcd store's access settings are an EtcdAccess, not {access!r}")
    return EtcdStore.from_url(url, timeout_s=options.timeout_s, access=access)


BACKEND = Backend(check_url, open_store)
