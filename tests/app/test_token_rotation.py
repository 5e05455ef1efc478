"""Tokens rotate without a restart: SIGHUP (or a changed file) makes the file's new tokens
valid while the old ones stay valid until the file drops them; a bad file keeps the previous
tokens and logs why; admins see the generation in force (GET /admin/tokens, ``status``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.pki import Pki
from harness.server import ROOT, RegistryProcess
from tests.app.api.conftest import agent_body
from tests.app.conftest import ADMIN, READER, tokens_file

pytestmark = pytest.mark.tls

OLD = "worker-token-old-0123456789"
NEW = "worker-token-new-9876543210"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def generation(api: httpx.Client) -> dict[str, Any]:
    answer = api.get("/admin/tokens", headers=bearer(ADMIN))
    assert answer.status_code == 200, answer.text
    status: dict[str, Any] = answer.json()
    return status


def wait_generation(api: httpx.Client, number: int, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = generation(api)
        if status["generation"] == number:
            return status
        time.sleep(0.05)
    raise AssertionError(f"generation {number} not in force within {timeout_s} s: {status}")


def heartbeat(api: httpx.Client, group: str, engine_id: str, token: str) -> int:
    """The fast path's heartbeat (FastAPI never sees it) with ``token``."""
    answer = api.post(
        f"/tp-groups/{group}/engine/agents/0/heartbeat",
        json={"engine_id": engine_id},
        headers=bearer(token),
    )
    return answer.status_code


def test_tokens_rotate_on_sighup_and_on_change_and_a_bad_file_keeps_the_previous(
    tmp_path: Path, pki: Pki
) -> None:
    lines = [f"admin:{ADMIN}", f"reader:{READER}"]
    tokens = tokens_file(tmp_path, *lines, f"worker:{OLD}")
    log = tmp_path / "registry.log"
    server = RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        tls=pki.https(),
        log_path=log,
    )
    with server, httpx.Client(base_url=server.url, verify=pki.https().client_context()) as api:
        assert server.proc is not None
        first = generation(api)
        assert first["generation"] == 1
        assert first["roles"] == {"admin": 1, "reader": 1, "worker": 1}
        assert api.get("/admin/tokens", headers=bearer(READER)).status_code == 403
        group = f"rot-{uuid.uuid4().hex[:8]}"
        opened = api.put(
            f"/tp-groups/{group}/engine",
            json={"launch_id": "l-1", "tp_size": 1, "role": "prefill"},
            headers=bearer(OLD),
        )
        engine_id = opened.json()["engine_id"]
        put = api.put(
            f"/tp-groups/{group}/engine/agents/0",
            json=agent_body(engine_id, 0),
            headers=bearer(OLD),
        )
        assert put.status_code == 201, put.text
        assert heartbeat(api, group, engine_id, NEW) == 401

        # 1. Add the new token, SIGHUP: old and new both valid.
        tokens_file(tmp_path, *lines, f"worker:{OLD}", f"worker:{NEW}")
        server.proc.send_signal(signal.SIGHUP)
        second = wait_generation(api, 2)
        assert second["roles"]["worker"] == 2
        assert second["sha256"] != first["sha256"]
        assert heartbeat(api, group, engine_id, OLD) == 200
        assert heartbeat(api, group, engine_id, NEW) == 200

        # 2. Drop the old one, no signal: the changed file is picked up on its own.
        tokens_file(tmp_path, *lines, f"worker:{NEW}")
        wait_generation(api, 3)
        assert heartbeat(api, group, engine_id, OLD) == 401
        assert heartbeat(api, group, engine_id, NEW) == 200

        # 3. A bad file: generation 3 stays in force, the log names the file and the line.
        tokens.write_text(f"admin:{ADMIN}\nworker {NEW}\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        errors: list[dict[str, Any]] = []
        while not errors and time.monotonic() < deadline:
            time.sleep(0.05)
            errors = [
                json.loads(line)
                for line in log.read_text().splitlines()
                if '"level": "error"' in line and "tokens file not reloaded" in line
            ]
        assert errors, log.read_text()[-2000:]
        assert f"{tokens} line 2" in errors[0]["msg"], errors
        assert NEW not in errors[0]["msg"]
        assert generation(api)["generation"] == 3
        assert heartbeat(api, group, engine_id, NEW) == 200

        # 4. An admin's status shows the generation; a reader's does not.
        def status(token: str) -> str:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "app",
                    "status",
                    "--url",
                    server.url,
                    "--token",
                    token,
                    "--ca",
                    str(pki.ca),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return done.stdout

        admin = status(ADMIN)
        assert f"tokens: generation 3, loaded {generation(api)['loaded_at']}" in admin, admin
        assert str(generation(api)["sha256"])[:12] in admin
        assert "tokens:" not in status(READER)
