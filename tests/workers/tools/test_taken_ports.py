"""A port picked free and taken by someone else before the child binds it (two xdist workers
picking the same port): the launchers never take the other server's answer for their own
child's. `RegistryProcess` and the etcd harness wait for the child itself to listen
(`listens_on`), and a picked port someone else holds is picked again. Before, a registry
fixture reached another worker's etcd, whose limits differed, and two tests failed. Fewer
such races to begin with: each test process picks in its own slice of the range, and a
process never hands out one port twice within `RECENT_S`."""

from __future__ import annotations

import http.server
import itertools
import json
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.etcd import SKIP_REASON, EtcdCluster, etcd_available
from workers.tools.procs import (
    PORTS,
    RegistryProcess,
    free_port,
    listens_on,
    port_slice,
    port_taken,
)

pytestmark = [pytest.mark.api, pytest.mark.timeout(120)]


class Impostor(http.server.BaseHTTPRequestHandler):
    """Answers every GET 200 as a healthy registry or etcd member would."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "health": "true", "impostor": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def impostor() -> Iterator[int]:
    """A server on a loopback port answering every probe healthy; yields the port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_concurrent_test_processes_pick_from_disjoint_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slices = []
    for worker in (None, "gw0", "gw1", "gw2"):
        if worker is None:
            monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        else:
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(port_slice())
    assert slices[0][0] == PORTS[0]
    assert slices[-1][1] <= PORTS[1]
    for (_, end), (start, _) in itertools.pairwise(slices):
        assert end <= start, slices
    low, high = slices[1]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert all(low <= free_port() < high for _ in range(50))


def test_a_port_handed_out_is_not_handed_out_again_before_its_child_could_bind_it() -> None:
    # 300 draws from a slice of 3,000 ports repeat about 15 times if drawn blindly.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_listens_on_tells_the_child_that_holds_the_port_from_any_other(
    impostor: int, tmp_path: Path
) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import http.server as h; h.test(h.SimpleHTTPRequestHandler, port=0, bind='127.0.0.1')",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30.0)
        assert ready, "the child did not say its port within 30 s"
        line = child.stdout.readline().decode()  # "Serving HTTP on 127.0.0.1 port N ..."
        port = int(line.split(" port ")[1].split()[0])
        assert listens_on(child.pid, port) is True
        assert listens_on(child.pid, impostor) is False
        shell = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])  # holds nothing
        try:
            assert listens_on(shell.pid, port) is False
        finally:
            shell.kill()
            shell.wait()
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert port_taken(impostor) is True


def test_a_registry_whose_picked_port_was_taken_serves_on_another(
    impostor: int, tmp_path: Path
) -> None:
    proc = RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", log_path=tmp_path / "r.log")
    proc.port = impostor  # as if another worker bound the picked port first
    with proc:
        assert proc.port != impostor, "the impostor's /healthz was taken for the child's"
        assert listens_on(proc.pid, proc.port) is True
        ready = httpx.get(f"{proc.url}/readyz", timeout=5.0).json()
        assert ready["status"] == "ready"
    assert "address already in use" in (tmp_path / "r.log").read_text()


def test_a_registry_on_a_port_it_was_given_fails_naming_the_taken_port(
    impostor: int, tmp_path: Path
) -> None:
    proc = RegistryProcess(
        f"sqlite:///{tmp_path / 'r.db'}", port=impostor, log_path=tmp_path / "r.log"
    )
    with pytest.raises(RuntimeError, match="address already in use") as refused:
        proc.start()
    assert proc.port == impostor
    assert f"'127.0.0.1', {impostor})" in str(refused.value)


@pytest.mark.skipif(not etcd_available(), reason=SKIP_REASON)
def test_an_etcd_member_whose_port_was_taken_is_laid_out_again(
    impostor: int, tmp_path: Path
) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", size=1)
    cluster.members[0].client_port = impostor
    with cluster:
        member = cluster.members[0]
        assert member.client_port != impostor, "the impostor's /health was taken for etcd's"
        assert member.proc is not None
        assert listens_on(member.proc.pid, member.client_port) is True
        with socket.create_connection(("127.0.0.1", member.client_port), timeout=5.0):
            pass
