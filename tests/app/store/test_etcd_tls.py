"""The etcd store over TLS with credentials, against a real etcd that serves TLS only,
requires client certificates (``--client-cert-auth``) and has authentication on: a stale auth
token renewed in place, refusals named with their cause and fix, and a registry process on
``etcds://`` (the contract itself runs on this etcd too: the ``etcds`` backend in conftest)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from app.store import EtcdAccess, Put
from app.store.etcd.conn import EtcdAccessError
from app.store.etcd.store import EtcdStore
from harness.etcd import SKIP_REASON, etcd_available
from harness.server import ROOT, RegistryProcess
from tests.app.store.conftest import SecureEtcd, shared_etcd, shared_secure_etcd
from tests.support.faults import agent_body, open_body

pytestmark = pytest.mark.store


def refusal_at_start(url: str, access: EtcdAccess) -> str:
    """What the store's start says when etcd refuses it (it must refuse)."""

    async def main() -> str:
        store = EtcdStore.from_url(url, timeout_s=5.0, access=access)
        try:
            with pytest.raises(EtcdAccessError) as refused:
                await store.start()
            return refused.value.detail
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.fixture
def secure() -> SecureEtcd:
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    return shared_secure_etcd()


def test_a_stale_auth_token_is_renewed_and_new_watches_use_the_new_one(
    secure: SecureEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.store")

    def renewed() -> bool:
        return any("auth token renewed" in r.getMessage() for r in caplog.records)

    async def main() -> None:
        url = secure.cluster.url(f"tls-{uuid.uuid4().hex}")
        store = EtcdStore.from_url(url, timeout_s=5.0, access=secure.access())
        try:
            await store.start()
            first = await store.txn([], [Put("k/a", b"1")])
            waiting = asyncio.create_task(store.wait("k/", first.revision, 10.0))
            await asyncio.sleep(0.2)
            await store.txn([], [Put("k/a", b"2")])
            assert await waiting  # a watch stream opened with the first token
            # etcd drops a token unused for --auth-token-ttl (1 s here, checked each second):
            # stay idle, then call; the store authenticates again and repeats the call.
            for _ in range(4):
                await asyncio.sleep(2.5)
                entry = await store.get("k/a")
                assert entry is not None
                assert entry.value == b"2"
                if renewed():
                    break
            assert renewed(), "etcd never dropped the token: the renewal was not exercised"
            # A watch added after the renewal (another segment: a watch of its own) goes on a
            # stream opened with the new token; etcd checks a stream's token when a watch is
            # added, so one added to the old stream would never fire.
            head = await store.txn([], [Put("j/b", b"1")])
            waiting = asyncio.create_task(store.wait("j/", head.revision, 5.0))
            await asyncio.sleep(0.2)
            await store.txn([], [Put("j/b", b"2")])
            assert await waiting
        finally:
            await store.close()

    asyncio.run(main())


def test_a_wrong_password_a_missing_role_or_an_untrusted_etcd_is_refused_at_start(
    secure: SecureEtcd, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")

    def start(url: str, **changes: object) -> str:
        return refusal_at_start(url, secure.access(**changes))

    mine = secure.cluster.url(f"tls-{uuid.uuid4().hex}")
    detail = start(mine, password_file=wrong)
    assert "etcd refused user registry: authentication failed" in detail, detail
    assert "check REGISTRY_ETCD_PASSWORD_FILE" in detail, detail
    outside = secure.cluster.url("not-granted")  # the role covers /tls-* only
    detail = start(outside)
    assert "denied user registry access to the store's keys" in detail, detail
    assert "grant-permission" in detail, detail
    # etcds:// without REGISTRY_ETCD_CA trusts the system's CAs, which did not sign etcd's.
    detail = start(mine, ca=None)
    where = secure.cluster.endpoints[0]
    assert f"TLS handshake with etcd at {where} failed: certificate verify failed" in detail
    assert "no REGISTRY_ETCD_CA given: the system's CAs were used" in detail, detail


def test_etcds_to_a_plain_etcd_is_refused_at_start() -> None:
    if not etcd_available():
        pytest.skip(SKIP_REASON)
    plain = shared_etcd()
    detail = refusal_at_start(plain.url("x", scheme="etcds"), EtcdAccess())
    assert f"TLS handshake with etcd at {plain.endpoints[0]} failed" in detail, detail
    assert "etcd does not serve TLS there" in detail, detail


def test_registry_on_etcds_serves_groups_and_agents_without_showing_credentials(
    secure: SecureEtcd, tmp_path: Path
) -> None:
    url = secure.cluster.url(f"tls-{uuid.uuid4().hex}")
    log = tmp_path / "registry.log"
    with (
        RegistryProcess(url, env=secure.env(), log_path=log) as registry,
        httpx.Client(base_url=registry.url, timeout=10.0) as http,
    ):
        opened = http.put("/tp-groups/prefill-0/engine", json=open_body(tp_size=1))
        assert opened.status_code == 201, opened.text
        engine_id = opened.json()["engine_id"]
        put = http.put("/tp-groups/prefill-0/engine/agents/0", json=agent_body(engine_id, 0))
        assert put.status_code == 201, put.text
        engine = http.get("/tp-groups/prefill-0/engine").json()
        assert engine["registered_ranks"] == [0], engine
        assert engine["ready"], engine
        ready = http.get("/readyz")
        assert ready.json() == {"status": "ready", "store": url}
        metrics = http.get("/metrics").text
    shown = log.read_text() + ready.text + metrics
    assert secure.user.password not in shown
    assert url in log.read_text()  # the store is named, without credentials


def test_misconfigured_registry_stops_at_start_naming_cause_and_fix(
    secure: SecureEtcd, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    url = secure.cluster.url(f"tls-{uuid.uuid4().hex}")
    where = secure.cluster.endpoints[0]
    env = secure.env()
    no_cert = {k: v for k, v in env.items() if k not in {"REGISTRY_ETCD_CERT", "REGISTRY_ETCD_KEY"}}
    cases = {
        "wrong CA": (
            url,
            env | {"REGISTRY_ETCD_CA": str(secure.tls.other_ca)},
            [
                f"TLS handshake with etcd at {where} failed: certificate verify failed",
                "set REGISTRY_ETCD_CA to the CA that signed etcd's certificate",
            ],
        ),
        "no client certificate": (
            url,
            no_cert,
            [
                f"etcd at {where} refused this client's TLS certificate (none",
                "--client-cert-auth; set REGISTRY_ETCD_CERT and REGISTRY_ETCD_KEY",
            ],
        ),
        "wrong password": (
            url,
            env | {"REGISTRY_ETCD_PASSWORD_FILE": str(wrong)},
            [
                "etcd refused user registry: authentication failed",
                "check REGISTRY_ETCD_PASSWORD_FILE",
            ],
        ),
        "plain etcd:// to a TLS etcd": (
            secure.cluster.url("tls-plain", scheme="etcd"),
            {},
            [
                f"etcd at {where} closed the connection during the handshake",
                "write the store as etcds://",
            ],
        ),
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", "0", "--store", store],
            cwd=ROOT,
            env=base | case_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, (store, case_env, _) in cases.items()
    }
    problems = []
    for name, proc in procs.items():
        try:
            output = proc.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0].decode(errors="replace")
            problems.append(f"{name}: still running after 60 s")
        if proc.returncode == 0:
            problems.append(f"{name}: exited 0")
        missing = [text for text in cases[name][2] if text not in output]
        if missing:
            problems.append(f"{name}: {missing} not in its output:\n{output[-3000:]}")
        if secure.user.password in output:
            problems.append(f"{name}: the password is in its output")
    assert not problems, "\n".join(problems)
