"""Store URLs: the scheme table and the etcd backend's own URL and credential rules (no server
needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")

from app.store import EtcdAccess, check_store_url, create_store
from app.store.etcd.config import parse_url, redact
from app.store.etcd.store import EtcdStore

pytestmark = pytest.mark.unit


def test_url_names_every_endpoint_and_the_prefix() -> None:
    parsed = parse_url("etcd://127.0.0.1:2379,[::1]:22379,etcd-2:32379/team-a")
    assert parsed.endpoints == [("127.0.0.1", 2379), ("[::1]", 22379), ("etcd-2", 32379)]
    assert parsed.prefix == "team-a"
    assert not parsed.tls
    assert parse_url("etcds://etcd-1:2379/team-a").tls


def test_url_without_prefix_uses_the_default_prefix() -> None:
    assert parse_url("etcd://127.0.0.1:2379").prefix == "engine-registry"
    assert parse_url("etcds://127.0.0.1:2379/").prefix == "engine-registry"


@pytest.mark.parametrize(
    "url",
    [
        "etcd:///registry",
        "etcd://127.0.0.1/registry",
        "etcd://h:99999/x",
        "etcd://:1/x",
        "etcds://h/x",
    ],
)
def test_bad_url_is_refused_with_an_example(url: str) -> None:
    with pytest.raises(ValueError, match="etcd://"):
        parse_url(url)
    with pytest.raises(ValueError, match="etcd://"):
        check_store_url(url)


def test_credentials_in_the_url_are_refused_and_never_echoed() -> None:
    with pytest.raises(ValueError, match="REGISTRY_ETCD_PASSWORD_FILE") as caught:
        check_store_url("etcds://reg:s3cret-pw@127.0.0.1:2379/x")
    assert "s3cret-pw" not in str(caught.value)
    assert redact("etcds://reg:s3cret-pw@h:1/x") == "etcds://***@h:1/x"
    with pytest.raises(ValueError, match="Unknown store URL") as unknown:
        check_store_url("redis://u:s3cret-pw@h:1/x")
    assert "s3cret-pw" not in str(unknown.value)


def test_the_scheme_table_checks_each_backend_url() -> None:
    assert check_store_url("sqlite:///registry.db?synchronous=full") == (
        "sqlite:///registry.db?synchronous=full"
    )
    with pytest.raises(ValueError, match=re.escape("synchronous=normal|full|extra")):
        check_store_url("sqlite:///registry.db?synchronous=off")
    with pytest.raises(ValueError, match="sqlite:////absolute"):
        check_store_url("sqlite://host/registry.db")


def test_create_store_builds_an_etcd_store_without_connecting() -> None:
    store = create_store("etcd://127.0.0.1:1/registry", timeout_s=3)
    assert isinstance(store, EtcdStore)
    assert store.description == "etcd://127.0.0.1:1/registry"


def test_credentials_need_etcds_and_readable_files(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("pw\n")
    user = EtcdAccess(user="reg", password_file=password)
    with pytest.raises(
        ValueError, match="REGISTRY_ETCD_USER, REGISTRY_ETCD_PASSWORD_FILE need an etcds:// store"
    ):
        user.check("etcd://127.0.0.1:2379/x")
    with pytest.raises(ValueError, match="apply to an etcd store"):
        user.check("sqlite:///registry.db")
    user.check("etcds://127.0.0.1:2379/x")
    assert user.read_password() == "pw"
    with pytest.raises(ValueError, match="REGISTRY_ETCD_USER=reg has no password"):
        EtcdAccess(user="reg").check("etcds://h:1/x")
    with pytest.raises(ValueError, match="REGISTRY_ETCD_CERT and REGISTRY_ETCD_KEY go together"):
        EtcdAccess(cert=password).check("etcds://h:1/x")
    with pytest.raises(ValueError, match=r"REGISTRY_ETCD_CA=.*holds no PEM certificate"):
        EtcdAccess(ca=password).check("etcds://h:1/x")
    with pytest.raises(ValueError, match=r"REGISTRY_ETCD_CA=.*cannot be read"):
        EtcdAccess(ca=tmp_path / "absent.pem").check("etcds://h:1/x")
    store = create_store("etcds://127.0.0.1:1/registry", timeout_s=3, etcd=user)
    assert store.description == "etcds://127.0.0.1:1/registry"
