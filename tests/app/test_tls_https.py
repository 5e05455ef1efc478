"""HTTPS: served with a certificate made at test time; plain HTTP to the port fails; a client
with the wrong CA fails at once with an error naming the URL and the fix; the server's
guards (header timeout, handshake bound) hold over TLS."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.pki import Pki
from harness.server import ROOT, RegistryProcess
from registry_client.client import RegistryClient
from registry_client.errors import RegistryUnavailable, Unauthorized
from registry_client.tls import ClientTLS, RegistryTLSError
from tests.app.conftest import READER, tokens_file

pytestmark = pytest.mark.tls


@pytest.fixture(scope="module")
def server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("https")
    tokens = tokens_file(d, f"reader:{READER}")
    with RegistryProcess(
        f"sqlite:///{d / 'registry.db'}",
        args=["--tokens-file", str(tokens), "--header-timeout-s", "2", "--watch-bookmark-s", "0.5"],
        tls=pki.https(),
        log_path=d / "registry.log",
    ) as proc:
        yield proc


def test_https_answers_with_the_ca_and_plain_http_to_the_port_fails(
    server: RegistryProcess, pki: Pki
) -> None:
    assert server.url.startswith("https://")
    verify = ssl.create_default_context(cafile=pki.ca)
    answer = httpx.get(f"{server.url}/healthz", verify=verify, timeout=10)
    assert answer.status_code == 200, answer.text
    with (
        socket.create_connection((server.host, server.port), timeout=10) as raw,
        verify.wrap_socket(raw, server_hostname=server.host) as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        assert tls.selected_alpn_protocol() in (None, "http/1.1")
    plain = f"http://{server.host}:{server.port}/healthz"
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain, timeout=5)


def test_the_watch_stream_is_served_over_https_with_the_token(
    server: RegistryProcess, pki: Pki
) -> None:
    tls = ClientTLS(ca=pki.ca)
    with RegistryClient(server.url, token=READER, tls=tls, timeout_s=10) as client:
        events = iter(client.watch(bookmarks=True, idle_timeout_s=5))
        sync, bookmark = next(events), next(events)
    assert sync.type == "SYNC"
    assert bookmark.type == "BOOKMARK"
    assert bookmark.revision >= sync.revision
    with (
        RegistryClient(server.url, tls=tls, timeout_s=10) as anonymous,
        pytest.raises(Unauthorized),
    ):
        next(iter(anonymous.watch(revision=0)))


def test_a_wrong_ca_fails_at_once_naming_the_url_and_the_setting(
    server: RegistryProcess, pki: Pki
) -> None:
    with (
        RegistryClient(server.url, tls=ClientTLS(ca=pki.other_ca), timeout_s=30) as client,
        pytest.raises(RegistryTLSError) as info,
    ):
        client.healthz()
    message = str(info.value)
    assert "certificate verify failed" in message, message
    assert server.url in message, message
    assert "WORKERS_REGISTRY_CA" in message, message
    # Not a retry loop until the 30 s deadline (that ends in RegistryUnavailable).
    assert not isinstance(info.value, RegistryUnavailable)
    # The system trust store (no CA given) does not know the test CA either.
    with RegistryClient(server.url, timeout_s=30) as client, pytest.raises(RegistryTLSError):
        client.healthz()


def test_a_replica_that_refuses_the_client_is_passed_over_for_one_that_answers(
    server: RegistryProcess, mutual_server: RegistryProcess, pki: Pki
) -> None:
    # The first replica wants a client certificate this client does not have.
    urls = [mutual_server.url, server.url]
    with RegistryClient(urls, tls=ClientTLS(ca=pki.ca), timeout_s=30) as client:
        assert client.healthz()
        assert client.url == server.url


def test_the_cli_names_the_url_and_the_flag_on_a_wrong_ca(
    server: RegistryProcess, pki: Pki
) -> None:
    def status(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "app", "status", "--url", server.url, "--token", READER]
        return subprocess.run(
            [*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )

    wrong = status("--ca", str(pki.other_ca))
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "certificate verify failed" in wrong.stderr, wrong.stderr
    assert server.url in wrong.stderr, wrong.stderr
    assert "--ca" in wrong.stderr, wrong.stderr
    missing = status("--ca", str(pki.ca.parent / "absent.pem"))
    assert missing.returncode == 2, missing.stderr
    assert "--ca" in missing.stderr, missing.stderr
    right = status("--ca", str(pki.ca))
    assert right.returncode == 0, right.stderr
    assert "no groups" in right.stdout
    assert "tokens:" not in right.stdout  # a reader does not see the tokens generation
    # http:// to the TLS port: the server closes without an answer; the message says why.
    plain = f"http://{server.host}:{server.port}"
    cmd = [sys.executable, "-m", "app", "status", "--url", plain, "--token", READER]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"cannot reach {plain}" in done.stderr, done.stderr
    assert "likely speaks TLS there; use https://" in done.stderr, done.stderr


def _read_all(conn: ssl.SSLSocket | socket.socket, deadline_s: float) -> bytes:
    """Everything until the peer closes, within ``deadline_s`` in all (not per read)."""
    deadline = time.monotonic() + deadline_s
    chunks: list[bytes] = []
    while True:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = conn.recv(65536)  # socket.timeout (TimeoutError) once the deadline passes
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def test_the_header_timeout_and_a_bounded_handshake_hold_over_tls(
    server: RegistryProcess, pki: Pki
) -> None:
    context = ssl.create_default_context(cafile=pki.ca)
    with (
        socket.create_connection((server.host, server.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server.host) as tls,
    ):
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answer = _read_all(tls, 30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["code"] == "request_timeout"
    # A connection that never starts the TLS handshake is closed by the server (after the
    # header timeout, 2 s here; asyncio's own default would hold it 60 s).
    with socket.create_connection((server.host, server.port), timeout=10) as raw:
        assert _read_all(raw, 30) == b""


def test_serving_plain_http_off_loopback_warns_naming_the_risk(tmp_path: Path) -> None:
    tokens = tokens_file(tmp_path, f"reader:{READER}")
    log = tmp_path / "registry.log"
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}",
        host="0.0.0.0",
        args=["--tokens-file", str(tokens)],
        log_path=log,
    ):
        pass
    warnings = [
        json.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"warning"' in line
    ]
    assert any(
        "plain HTTP on 0.0.0.0" in w["msg"] and "--tls-cert" in w["msg"] for w in warnings
    ), warnings
