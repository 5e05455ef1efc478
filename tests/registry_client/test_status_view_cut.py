"""``engine-registry status --watch`` against a stream cut in the middle of a revision: two
groups' leases lapse together (one revision, two lines) and the stream is cut after the first
line (tests/support/cut_proxy.py, in front of a real registry process). Resuming from the
highest revision seen would lose the second group's change for good; the CLI watches through
`registry_client.client`'s watch, which resumes from just before that revision and skips what it
had.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.server import ROOT, RegistryProcess
from tests.app.api.conftest import agent_body, launch
from tests.registry_client.test_status_view import Output, _sigint_default
from tests.support.cut_proxy import CutProxy

pytestmark = [pytest.mark.api, pytest.mark.timeout(120)]
TTL_S = 5


def row(frame: str, gid: str) -> str:
    [line] = [x for x in frame.split("\n") if re.match(rf"^[ *+] {gid}\s", x)]
    return line


def test_a_revision_cut_after_its_first_group_loses_nothing(tmp_path: Path) -> None:
    env = {"REGISTRY_WATCH_BOOKMARK_S": "1"}
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'r.db'}", env=env, log_path=tmp_path / "registry.log"
    ) as registry:
        c = httpx.Client(base_url=registry.url, timeout=10)
        proxy = CutProxy(registry.url)
        cmd = [
            sys.executable,
            "-m",
            "app",
            "status",
            "--watch",
            "--interval",
            "0.3",
            "--url",
            proxy.url,
        ]
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_sigint_default,
        )
        out = Output(proc)
        try:
            out.wait_frame("0 groups")
            engines = {}
            for gid in ("alpha", "beta"):
                body = {"launch_id": launch(), "tp_size": 1, "role": "prefill"}
                engines[gid] = c.put(f"/tp-groups/{gid}/engine", json=body).json()["engine_id"]

            def register(gid: str) -> int:
                body = agent_body(engines[gid], 0, ttl_s=TTL_S)
                return c.put(f"/tp-groups/{gid}/engine/agents/0", json=body).status_code

            # Registered together, never renewed: both leases lapse in one sweep, one revision.
            with ThreadPoolExecutor(2) as pool:
                assert list(pool.map(register, ["alpha", "beta"])) == [201, 201]
            ready = out.wait_frame("2 groups, 2 ready")
            assert "1/1 ready" in row(ready, "alpha")
            assert "1/1 ready" in row(ready, "beta")

            lapsed = out.wait_frame("2 groups, 0 ready", timeout_s=TTL_S + 15)
            assert proxy.cut, "the two leases did not lapse in one revision: nothing was cut"
            assert sorted(line["object"]["group_id"] for line in proxy.cut) == ["alpha", "beta"]
            assert "0/1" in row(lapsed, "alpha")
            assert "0/1" in row(lapsed, "beta")
        finally:
            proc.kill()
            proc.wait(timeout=5)
            out.close()
            proxy.close()
            c.close()
