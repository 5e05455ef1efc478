"""The network-namespace hosts (tests/support/netns.py) carry traffic with Docker running.

A Docker daemon sets the host's iptables `FORWARD` policy to `DROP`, and bridged traffic
passes that chain (`bridge-nf-call-iptables`). The two-host and Kubernetes topology tests
(tests/docker/test_two_hosts.py, tests/deploy/test_k8s_topology.py) lost their traffic on a
machine where Docker ran. This test starts a real daemon (or uses the running one), checks
that its rules are in place, and sends HTTP from one namespace host to another.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support import dockerd, netns

SKIP_REASON = netns.unavailable_reason() or dockerd.unavailable_reason()
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"namespaces beside Docker: {SKIP_REASON}"),
    pytest.mark.timeout(180),
]


def test_namespace_hosts_reach_each_other_with_dockers_forward_drop_in_place(
    docker_engine: dockerd.DockerEngine, tmp_path: Path
) -> None:
    assert dockerd.forward_policy() == "DROP", "Docker's rules are what this test is about"
    with netns.Network(subnet="10.233.0") as net:
        server, client = net.add_host("server"), net.add_host("client")
        net.write_hosts()
        proc = server.spawn(
            "http",
            [sys.executable, "-m", "http.server", "--bind", server.address, "8000"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=tmp_path,
            log_path=tmp_path / "http.log",
        )
        fetch = (
            "import sys, time, urllib.request\n"
            "end = time.monotonic() + 10\n"
            "while True:\n"
            "    try:\n"
            "        print(urllib.request.urlopen(sys.argv[1], timeout=2).status); break\n"
            "    except OSError as e:\n"
            "        if time.monotonic() > end: raise SystemExit(repr(e))\n"
            "        time.sleep(0.2)\n"
        )
        started = time.monotonic()
        answer = client.run([sys.executable, "-c", fetch, "http://server:8000/"], timeout_s=30)
        assert answer.returncode == 0, (
            f"client -> server over the bridge failed after {time.monotonic() - started:.1f}s "
            f"with FORWARD policy {dockerd.forward_policy()}: {answer.stderr or answer.stdout}"
            f"\n{proc.tail()}"
        )
        assert answer.stdout.strip() == "200"
        net.close()
        assert net.leftovers() == []
