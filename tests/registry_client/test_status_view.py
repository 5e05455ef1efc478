"""``engine-registry status --watch`` as a person runs it: a real registry process, the CLI in
a subprocess, frames read from its output, Ctrl-C (SIGINT) to end it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.server import ROOT, RegistryProcess
from tests.app.api.conftest import agent_body, launch

pytestmark = pytest.mark.api

HOME = "\x1b[H"
# A frame is read once the next one starts, and a quiet watch redraws at each BOOKMARK (5 s by
# default): a bookmark each 0.5 s keeps every wait for a frame short. The frames, and what they
# must show, are the same.
QUIET = {"REGISTRY_WATCH_BOOKMARK_S": "0.5"}


class Output:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.text = ""
        self._lock = threading.Lock()
        assert proc.stdout is not None
        stream = proc.stdout
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()
        self._stream = stream

    def close(self) -> None:
        """After the process ended: the reader sees end of file; the pipe is closed."""
        self._reader.join(timeout=5)
        self._stream.close()

    def _read(self, stream: object) -> None:
        while chunk := stream.read1(65536):  # type: ignore[attr-defined]
            with self._lock:
                self.text += chunk.decode()

    def frames(self) -> list[str]:
        with self._lock:
            return self.text.split(HOME)[1:]

    def wait_frame(self, needle: str, timeout_s: float = 15.0) -> str:
        """The first complete frame (seen from the next one on) that contains ``needle``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for frame in self.frames()[:-1]:
                if needle in frame:
                    return frame
            time.sleep(0.05)
        raise AssertionError(f"no frame with {needle!r} in {timeout_s} s: {self.frames()[-2:]}")


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_watch_marks_changes_survives_a_lost_registry_and_exits_on_ctrl_c(
    tmp_path: Path,
) -> None:
    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", env=QUIET) as registry:
        c = httpx.Client(base_url=registry.url, timeout=10)
        body = {"launch_id": launch(), "tp_size": 2, "role": "prefill"}
        eid = c.put("/tp-groups/alpha/engine", json=body).json()["engine_id"]
        cmd = [
            sys.executable,
            "-m",
            "app",
            "status",
            "--watch",
            "--interval",
            "0.3",
            "--url",
            registry.url,
        ]
        # SIGINT as a terminal's Ctrl-C delivers it, whatever this test process inherited
        # (a background job of a non-interactive shell, or nohup, starts with it ignored).
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_sigint_default,
        )
        out = Output(proc)
        try:
            first = out.wait_frame("alpha")
            assert "1 groups, 0 ready; 0 changed" in first
            assert c.put("/tp-groups/alpha/engine/agents/0", json=agent_body(eid, 0)).is_success
            assert "* alpha" in out.wait_frame("* alpha")
            c.put("/tp-groups/beta/engine", json={**body, "launch_id": launch()})
            assert "  alpha" in out.wait_frame("+ beta")
            c.delete("/tp-groups/alpha")
            out.wait_frame("- alpha (gone)")
            registry.stop()
            lost = out.wait_frame("REGISTRY UNREACHABLE")
            assert "beta" in lost  # the last table stays on screen
            registry.start()
            out.wait_frame("1 groups, 0 ready; 0 changed")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
            assert out.text.endswith("\x1b[?25h\n")  # the cursor is given back
            assert "Traceback" not in out.text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
            out.close()
            c.close()


def test_watch_takes_ctrl_c_even_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    with RegistryProcess(f"sqlite:///{tmp_path / 'r.db'}", env=QUIET) as registry:
        cmd = [
            sys.executable,
            "-m",
            "app",
            "status",
            "--watch",
            "--interval",
            "0.3",
            "--url",
            registry.url,
        ]
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_sigint_ignored,
        )
        out = Output(proc)
        try:
            out.wait_frame("0 groups")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
            assert out.text.endswith("\x1b[?25h\n")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
            out.close()
