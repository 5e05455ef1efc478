"""Bearer tokens with reader/worker/admin roles; start-up refusal off loopback without tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import ROOT, RegistryProcess, free_port
from tests.app.api.conftest import agent_body, invalid, new_gid, problem, sqlite_url

pytestmark = pytest.mark.api

READER = "reader-token-7f3a9c1d2e"
WORKER = "worker-token-b81e44a0c9"
ADMIN = "admin-token-5d2c0f7e8a61"
WRONG = "wrong-token-0000000000"
TOKENS = f"""# roles for the API tests
reader:{READER}
worker:{WORKER}   # the ranks
admin:{ADMIN}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    directory = tmp_path_factory.mktemp("auth")
    tokens = directory / "tokens"
    tokens.write_text(TOKENS)
    with RegistryProcess(
        sqlite_url(directory),
        args=["--tokens-file", str(tokens)],
        log_path=directory / "registry.log",
    ) as proc:
        yield proc


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def open_engine(api: httpx.Client, group: str, token: str = WORKER) -> httpx.Response:
    return api.put(
        f"/tp-groups/{group}/engine",
        json={"launch_id": uuid.uuid4().hex, "tp_size": 1, "role": "prefill"},
        headers=bearer(token) if token else {},
    )


def unauthorized(resp: httpx.Response) -> None:
    problem(resp, 401, "unauthorized")
    assert resp.headers["www-authenticate"].startswith("Bearer")
    assert resp.headers["x-request-id"]


def test_a_request_without_a_token_is_401_with_www_authenticate(api: httpx.Client) -> None:
    unauthorized(api.get("/tp-groups"))
    unauthorized(api.get(f"/tp-groups/{new_gid()}/engine"))
    unauthorized(api.get(f"/engines/{uuid.uuid4()}"))
    unauthorized(open_engine(api, new_gid(), token=""))


@pytest.mark.parametrize(
    "header",
    [f"Bearer {WRONG}", f"Basic {READER}", READER, "Bearer", f"Bearer {READER[:-1]}"],
    ids=["wrong-token", "basic-scheme", "no-scheme", "empty-bearer", "prefix-of-a-token"],
)
def test_a_request_with_a_wrong_token_is_401(api: httpx.Client, header: str) -> None:
    unauthorized(api.get("/tp-groups", headers={"Authorization": header}))


def test_reader_can_read_but_not_write(api: httpx.Client) -> None:
    group = new_gid()
    engine = open_engine(api, group).json()
    for path in ("/tp-groups", f"/tp-groups/{group}/engine", f"/engines/{engine['engine_id']}"):
        assert api.get(path, headers=bearer(READER)).status_code == 200, path
    problem(open_engine(api, new_gid(), token=READER), 403, "forbidden")
    resp = api.put(
        f"/tp-groups/{group}/engine/agents/0",
        json=agent_body(engine["engine_id"], 0),
        headers=bearer(READER),
    )
    problem(resp, 403, "forbidden")
    resp = api.post(
        f"/engines/{engine['engine_id']}/handshake",
        json={"tp_size": 1, "rank": 0},
        headers=bearer(READER),
    )
    problem(resp, 403, "forbidden")
    problem(api.delete(f"/tp-groups/{group}", headers=bearer(READER)), 403, "forbidden")


def test_worker_can_run_a_group_but_not_delete_it(api: httpx.Client) -> None:
    group = new_gid()
    opened = open_engine(api, group, token=WORKER)
    assert opened.status_code == 201, opened.text
    eid = opened.json()["engine_id"]
    agent_url = f"/tp-groups/{group}/engine/agents/0"
    w = bearer(WORKER)
    assert api.put(agent_url, json=agent_body(eid, 0), headers=w).status_code == 201
    assert api.post(f"{agent_url}/heartbeat", json={"engine_id": eid}, headers=w).status_code == 200
    hs = api.post(f"/engines/{eid}/handshake", json={"tp_size": 1, "rank": 0}, headers=w)
    assert hs.status_code == 200, hs.text
    assert api.get(f"/tp-groups/{group}/engine", headers=w).status_code == 200
    assert api.delete(agent_url, params={"engine_id": eid}, headers=w).status_code == 204
    problem(api.delete(f"/tp-groups/{group}", headers=w), 403, "forbidden")
    assert api.get(f"/tp-groups/{group}/engine", headers=w).status_code == 200


def test_admin_can_do_everything_including_deleting_a_group(api: httpx.Client) -> None:
    group = new_gid()
    a = bearer(ADMIN)
    assert open_engine(api, group, token=ADMIN).status_code == 201
    assert api.get("/tp-groups", headers=a).status_code == 200
    assert api.delete(f"/tp-groups/{group}", headers=a).status_code == 204
    problem(api.get(f"/tp-groups/{group}/engine", headers=a), 404, "not_found")


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"])
def test_public_paths_need_no_token(api: httpx.Client, path: str) -> None:
    assert api.get(path).status_code == 200


def test_authentication_is_checked_before_the_body_is_parsed(api: httpx.Client) -> None:
    group = new_gid()
    # Malformed JSON, invalid path, invalid query: without a token all are 401, not 422.
    unauthorized(api.put(f"/tp-groups/{group}/engine", content=b"{broken"))
    unauthorized(api.put("/tp-groups/UPPER/engine", content=b"{broken"))
    unauthorized(api.get(f"/tp-groups/{group}/engine", params={"wait_ready": 999}))
    unauthorized(api.delete(f"/tp-groups/{group}/engine/agents/0"))
    unauthorized(api.get(f"/tp-groups/{group}/engine"))  # unknown group: 401, not 404
    # A role too weak is 403 before any 422 or 404.
    problem(
        api.put(f"/tp-groups/{group}/engine", content=b"{broken", headers=bearer(READER)),
        403,
        "forbidden",
    )
    problem(api.delete("/tp-groups/UPPER", headers=bearer(WORKER)), 403, "forbidden")
    # With enough rights the shape is checked next.
    invalid(api.put(f"/tp-groups/{group}/engine", content=b"{broken", headers=bearer(WORKER)))


def test_tokens_never_appear_in_the_server_log(api: httpx.Client, server: RegistryProcess) -> None:
    group = new_gid()
    open_engine(api, group, token=WORKER)
    open_engine(api, group, token=ADMIN)
    api.get("/tp-groups", headers=bearer(READER))
    api.get("/tp-groups", headers=bearer(WRONG))
    api.put(f"/tp-groups/{group}/engine", content=b"{x", headers=bearer(WORKER))
    api.get(f"/tp-groups/{group}/engine?token={WRONG}", headers=bearer(READER))
    assert server.log_path is not None
    deadline = time.monotonic() + 5
    text = server.log_path.read_text()
    while '"status": 422' not in text:  # the log has caught up with our requests
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.05)
        text = server.log_path.read_text()
    assert "request" in text
    for token in (READER, WORKER, ADMIN):
        assert token not in text, f"token of length {len(token)} found in the log"


# -- starting up -----------------------------------------------------------------------------


def serve_cmd(tmp_path: Path, host: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "app",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--store",
        sqlite_url(tmp_path),
        *extra,
    ]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_serving_off_loopback_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    done = subprocess.run(
        serve_cmd(tmp_path, "0.0.0.0", free_port()),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "tokens" in done.stderr.lower(), done.stderr
    assert "--insecure" in done.stderr, done.stderr
    assert "Uvicorn running" not in done.stderr
    assert not (tmp_path / "registry.db").exists()


def test_serving_off_loopback_by_environment_without_tokens_refuses_to_start(
    tmp_path: Path,
) -> None:
    env = {**clean_env(), "REGISTRY_HOST": "0.0.0.0", "REGISTRY_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--store", sqlite_url(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "tokens" in done.stderr.lower(), done.stderr


def test_a_tokens_file_with_a_short_token_refuses_to_start(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("admin:short-secret\n")
    done = subprocess.run(
        serve_cmd(tmp_path, "127.0.0.1", free_port(), "--tokens-file", str(tokens)),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "16" in done.stderr, done.stderr
    assert "short-secret" not in done.stderr


def test_a_tokens_file_with_an_unknown_role_refuses_to_start_without_echoing_the_token(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader:{READER}\nsuperuser:{ADMIN}\n")
    done = subprocess.run(
        serve_cmd(tmp_path, "127.0.0.1", free_port(), "--tokens-file", str(tokens)),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "line 2" in done.stderr, done.stderr
    assert ADMIN not in done.stderr
    assert READER not in done.stderr


def test_serving_off_loopback_with_insecure_starts(tmp_path: Path) -> None:
    port = free_port("0.0.0.0")
    log = tmp_path / "insecure.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_cmd(tmp_path, "0.0.0.0", port, "--insecure"),
            cwd=ROOT,
            env=clean_env(),
            stdout=out,
            stderr=out,
        )
        try:
            deadline = time.monotonic() + 20
            served = False
            while not served:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                try:
                    # Loopback only: the wildcard listener answers there too.
                    served = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).is_success
                except httpx.HTTPError:
                    time.sleep(0.05)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
