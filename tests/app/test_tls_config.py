"""TLS and tokens configuration errors: each names the setting or file and the fix."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from app.security.credentials import digest_of
from app.security.tls import TlsConfigError, server_context
from app.security.tokens import TokenSource
from app.server.settings import Settings
from harness.pki import Pki
from harness.server import ROOT
from registry_client.tls import VARS_OF_PLUGIN, ClientTLS, TLSConfigError, classify
from tests.app.conftest import ADMIN, WORKER, tokens_file

pytestmark = pytest.mark.tls


def test_the_server_context_is_tls_1_2_or_newer_and_mutual_only_with_a_client_ca(
    pki: Pki,
) -> None:
    plain = server_context(pki.server_cert, pki.server_key)
    assert plain.minimum_version == ssl.TLSVersion.TLSv1_2
    assert plain.verify_mode == ssl.CERT_NONE
    mutual = server_context(pki.server_cert, pki.server_key, pki.ca)
    assert mutual.verify_mode == ssl.CERT_REQUIRED


def test_a_key_that_is_not_the_certificates_is_refused_naming_both(pki: Pki) -> None:
    with pytest.raises(TlsConfigError) as info:
        server_context(pki.server_cert, pki.client_key)
    assert str(pki.server_cert) in str(info.value)
    assert str(pki.client_key) in str(info.value)
    with pytest.raises(TlsConfigError, match="REGISTRY_TLS_CLIENT_CA"):
        server_context(pki.server_cert, pki.server_key, pki.ca.parent / "absent.pem")


def test_serve_stops_with_status_2_on_an_unusable_certificate(pki: Pki, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--port",
            "0",
            "--store",
            f"sqlite:///{tmp_path / 'r.db'}",
            "--tls-cert",
            str(pki.server_cert),
            "--tls-key",
            str(pki.client_key),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "REGISTRY_TLS_KEY" in done.stderr


def test_settings_need_the_certificate_and_key_together(pki: Pki) -> None:
    with pytest.raises(ValidationError, match="both --tls-cert and --tls-key"):
        Settings(tls_cert=pki.server_cert)
    with pytest.raises(ValidationError, match="--tls-client-ca"):
        Settings(tls_client_ca=pki.ca)
    Settings(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)


def test_client_tls_names_the_variable_of_a_missing_file(pki: Pki) -> None:
    with pytest.raises(TLSConfigError, match=r"ENGINE_REGISTRY_CA .*absent\.pem"):
        ClientTLS.from_env(VARS_OF_PLUGIN, {"ENGINE_REGISTRY_CA": str(pki.ca) + ".absent.pem"})
    with pytest.raises(TLSConfigError, match="WORKERS_REGISTRY_KEY is set but"):
        ClientTLS(key=pki.client_key)
    nothing = ClientTLS.from_env(None, {"WORKERS_REGISTRY_CA": " "})
    assert nothing.ca is None
    assert nothing.context.verify_mode == ssl.CERT_REQUIRED  # the system store, verified
    assert nothing.context.check_hostname


def test_client_tls_takes_text_paths_and_a_variables_prefix(pki: Pki) -> None:
    files = (str(pki.ca), str(pki.client_cert), str(pki.client_key))
    env = dict(zip(("PFX_CA", "PFX_CERT", "PFX_KEY"), files, strict=True))
    by_prefix = ClientTLS.from_env("PFX", env)
    assert (by_prefix.ca, by_prefix.cert, by_prefix.key) == tuple(map(Path, files))
    assert by_prefix.key_name == "PFX_KEY"
    assert ClientTLS(*files).cert == pki.client_cert
    assert ClientTLS(*files).context.verify_mode == ssl.CERT_REQUIRED


def test_a_refused_connection_is_weather_not_a_tls_failure() -> None:
    with pytest.raises(httpx.ConnectError) as info:
        httpx.get("https://127.0.0.1:1/", timeout=2)
    assert classify(info.value) is None


def test_a_reload_never_turns_authentication_off(tmp_path: Path) -> None:
    path = tokens_file(tmp_path, f"admin:{ADMIN}", f"worker:{WORKER}")
    source = TokenSource(path, None)
    path.write_text("# emptied by mistake\n")
    assert not source.reload("test")
    assert source.tokens.keys() == {digest_of(ADMIN), digest_of(WORKER)}
    assert source.generation.number == 1
    path.write_text(f"admin:{ADMIN}\n")
    assert source.reload("test")
    assert source.tokens.keys() == {digest_of(ADMIN)}
    assert source.generation.number == 2
