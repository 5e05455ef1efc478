"""The etcd store's URL: endpoints and key prefix (no server needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")

from app.store import create_store
from app.store.etcd import EtcdStore, parse_url


def test_url_names_every_endpoint_and_the_prefix() -> None:
    endpoints, prefix = parse_url("etcd://127.0.0.1:2379,[::1]:22379,etcd-2:32379/team-a")
    assert endpoints == [("127.0.0.1", 2379), ("[::1]", 22379), ("etcd-2", 32379)]
    assert prefix == "team-a"


def test_url_without_prefix_uses_the_default_prefix() -> None:
    assert parse_url("etcd://127.0.0.1:2379")[1] == "engine-registry"
    assert parse_url("etcd://127.0.0.1:2379/")[1] == "engine-registry"


@pytest.mark.parametrize(
    "url", ["etcd:///registry", "etcd://127.0.0.1/registry", "etcd://h:99999/x", "etcd://:1/x"]
)
def test_bad_url_is_refused_with_an_example(url: str) -> None:
    with pytest.raises(ValueError, match="etcd://"):
        parse_url(url)


def test_create_store_builds_an_etcd_store_without_connecting() -> None:
    store = create_store("etcd://127.0.0.1:1/registry", timeout_s=3)
    assert isinstance(store, EtcdStore)
    assert store.description == "etcd://127.0.0.1:1/registry"
