"""The tokens file under hostile changes, against a real registry process (issue #22): a
SIGHUP in the middle of a rewrite in place never loads the half-written file, and a FIFO put
in the file's place never blocks the service."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server import RegistryProcess

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]

WORKER = "worker-token-at-the-bottom-3f9a"
FILLER = [f"reader:reader-token-filler-{i:04d}-abcdef" for i in range(400)]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegistryProcess, Path]]:
    """One registry for the module: the FIFO test, last, leaves its tokens file unusable."""
    tmp_path = tmp_path_factory.mktemp("tokens")
    tokens = tmp_path / "tokens"
    tokens.write_text("\n".join([*FILLER, f"worker:{WORKER}", ""]))
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        log_path=tmp_path / "registry.log",
    ) as proc:
        yield proc, tokens


def refused_while(proc: RegistryProcess, action: threading.Thread, after_s: float) -> list[int]:
    """Statuses other than 200 for the bottom token while ``action`` runs and ``after_s``
    seconds after it."""
    bad: list[int] = []
    with httpx.Client(base_url=proc.url, timeout=5.0) as http:
        action.start()
        deadline = None
        while deadline is None or time.monotonic() < deadline:
            status = http.get("/tp-groups", headers={"Authorization": f"Bearer {WORKER}"})
            if status.status_code != 200:
                bad.append(status.status_code)
            if deadline is None and not action.is_alive():
                deadline = time.monotonic() + after_s
            time.sleep(0.02)
    return bad


def test_sighup_during_a_rewrite_in_place_never_loads_the_half_written_file(
    registry: tuple[RegistryProcess, Path],
) -> None:
    proc, tokens = registry
    text = "\n".join([*FILLER, f"worker:{WORKER}", "# rewritten", ""]).encode()
    time.sleep(1.1)  # the file as started is older than the settle time

    def rewrite() -> None:
        with tokens.open("wb") as f:  # truncated, then written in two halves
            f.write(text[: len(text) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(proc.pid, signal.SIGHUP)
            time.sleep(0.4)
            f.write(text[len(text) // 2 :])

    bad = refused_while(proc, threading.Thread(target=rewrite), after_s=2.5)
    assert bad == [], f"the bottom token was refused {len(bad)} times: {sorted(set(bad))}"


def test_a_fifo_in_place_of_the_tokens_file_never_blocks_the_service(
    registry: tuple[RegistryProcess, Path], tmp_path: Path
) -> None:
    proc, tokens = registry
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.replace(fifo, tokens)
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(2.5)  # the poller has looked at it twice
    with httpx.Client(base_url=proc.url, timeout=2.0) as http:
        assert http.get("/healthz").status_code == 200
        answer = http.get("/tp-groups", headers={"Authorization": f"Bearer {WORKER}"})
        assert answer.status_code == 200  # the tokens in force stay
    log = Path(proc.log_path or "").read_text()
    assert "is not a regular file" in log
