"""Mutual TLS: a client without a certificate signed by the client CA is refused during the
handshake; the worker library, the vLLM plugin's registration code and the probe register
and read over it with their certificates."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import uuid

import pytest

from harness.pki import Pki
from harness.server import ROOT, RegistryProcess
from registry_client.client import RegistryClient
from registry_client.models import KvSpec
from registry_client.tls import ClientTLS, RegistryTLSError
from tests.app.conftest import ADMIN, WORKER

pytestmark = pytest.mark.tls

KV = KvSpec(mem_type="DRAM", device_id=0, base_addrs=[4096], num_blocks=8, block_len=65536)


def refused_handshake(context: ssl.SSLContext, host: str, port: int) -> None:
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False) as tls,
        pytest.raises(ssl.SSLError),
    ):
        tls.do_handshake()


def test_a_client_without_a_certificate_is_refused_during_the_handshake(
    mutual_server: RegistryProcess, pki: Pki
) -> None:
    context = ssl.create_default_context(cafile=pki.ca)
    # TLS 1.2: the server's refusal ends the handshake itself (TLS 1.3 sends it after).
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    host, port = mutual_server.host, mutual_server.port
    refused_handshake(context, host, port)
    # A certificate from a CA the registry does not trust is refused the same way.
    context.load_cert_chain(pki.other_client_cert, pki.other_client_key)
    refused_handshake(context, host, port)
    # With its certificate the same client completes the handshake.
    context.load_cert_chain(pki.client_cert, pki.client_key)
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        assert tls.version() == "TLSv1.2"


def test_the_worker_library_without_its_certificate_fails_at_once_naming_the_fix(
    mutual_server: RegistryProcess, pki: Pki
) -> None:
    with (
        RegistryClient(
            mutual_server.url, token=WORKER, tls=ClientTLS(ca=pki.ca), timeout_s=30
        ) as client,
        pytest.raises(RegistryTLSError) as info,
    ):
        client.healthz()
    message = str(info.value)
    assert mutual_server.url in message, message
    assert "WORKERS_REGISTRY_CERT" in message, message
    assert "client certificate" in message, message


def test_the_worker_library_registers_over_mutual_tls(
    mutual_server: RegistryProcess, pki: Pki
) -> None:
    tls = ClientTLS.from_env(
        None,
        {
            "WORKERS_REGISTRY_CA": str(pki.ca),
            "WORKERS_REGISTRY_CERT": str(pki.client_cert),
            "WORKERS_REGISTRY_KEY": str(pki.client_key),
        },
    )
    group = f"tls-{uuid.uuid4().hex[:8]}"
    with RegistryClient(mutual_server.url, token=WORKER, tls=tls) as client:
        engine, created = client.open_engine(
            group, launch_id=uuid.uuid4().hex, tp_size=1, role="prefill"
        )
        assert created
        _, new = client.register_agent(
            group,
            0,
            engine_id=engine.engine_id,
            agent_name="rank-0",
            agent_metadata=b"nixl-metadata",
            host="10.0.0.5",
            kv=KV,
        )
        assert new
        client.heartbeat(group, 0, engine_id=engine.engine_id)
        ready = client.get_engine(group)
        assert ready.ready
        assert ready.registered_ranks == [0]


def test_the_vllm_plugin_registers_over_mutual_tls(
    mutual_server: RegistryProcess, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's settings, first-process token check and lease (the shared Publication,
    as the plugin's worker side runs it), against the real registry; no vLLM is started."""
    from registry_client.models import EngineIdentity
    from workers.publication import Publication
    from workers.vllm_plugin import common, hook
    from workers.vllm_plugin.settings import PluginConfigError, PluginSettings

    group = f"vllm-tls-{uuid.uuid4().hex[:8]}"
    for name, value in {
        "ENGINE_REGISTRY_URL": mutual_server.url,
        "ENGINE_REGISTRY_GROUP": group,
        "ENGINE_REGISTRY_TOKEN": WORKER,
        "ENGINE_REGISTRY_LAUNCH_ID": uuid.uuid4().hex,
        "ENGINE_REGISTRY_CA": str(pki.ca),
        "ENGINE_REGISTRY_CERT": str(pki.client_cert),
        "ENGINE_REGISTRY_KEY": str(pki.client_key),
    }.items():
        monkeypatch.setenv(name, value)
    settings = PluginSettings.from_env()
    hook.check_token(settings)  # refuses the launch only on 401/403
    with common.client(settings) as client:
        engine, _ = client.open_engine(
            group, launch_id=settings.launch_id, tp_size=1, role="prefill"
        )
    identity = EngineIdentity(
        group, engine.engine_id, engine.generation, settings.urls, settings.launch_id
    )
    publication = Publication(
        lambda: common.client(settings),
        identity,
        0,
        agent_name=f"{engine.engine_id}-rank0",
        metadata=b"nixl",
        host="10.0.0.7",
        kv=KV,
        ttl_s=settings.ttl_s,
    )
    publication.publish()
    publication.start()
    with common.client(settings) as client:
        assert client.get_engine(group).registered_ranks == [0]
        publication.close()
        assert client.get_engine(group).registered_ranks == []
    # Without its certificate the plugin fails at start, naming its own variable.
    monkeypatch.delenv("ENGINE_REGISTRY_CERT")
    monkeypatch.delenv("ENGINE_REGISTRY_KEY")
    with (
        common.client(PluginSettings.from_env()) as client,
        pytest.raises(RegistryTLSError) as info,
    ):
        client.get_engine(group)
    assert "ENGINE_REGISTRY_CERT" in str(info.value)
    monkeypatch.setenv("ENGINE_REGISTRY_CA", str(pki.ca.parent / "absent.pem"))
    with pytest.raises(PluginConfigError, match="ENGINE_REGISTRY_CA"):
        PluginSettings.from_env()


def test_probe_and_status_over_mutual_tls(mutual_server: RegistryProcess, pki: Pki) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "app", *args, "--url", mutual_server.url],
            cwd=ROOT,
            env={**os.environ, "REGISTRY_TOKEN": WORKER},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    certs = ["--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    probe = cli("probe", "--group", "never-opened", *certs)
    assert probe.returncode == 1, probe.stdout + probe.stderr  # reached it: not ready
    assert "has no engine" in probe.stdout
    refused = cli("probe", "--group", "never-opened", "--ca", str(pki.ca))
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "--cert" in refused.stderr, refused.stderr
    status = cli("status", "--token", ADMIN, *certs)
    assert status.returncode == 0, status.stderr
    assert "tokens: generation 1" in status.stdout, status.stdout
