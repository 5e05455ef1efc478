"""docker/compose.yaml driven with Debian's docker-compose against a real Docker engine.

A `Compose` is one project (its own name, so a stale run's containers are found and removed)
over some compose files, an optional `--env-file` and the shell variables the operator would
export. It starts services, waits for health and exits as Docker reports them, and reads logs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPOSE_BIN = shutil.which("docker-compose")


@dataclass
class Compose:
    docker: str
    files: list[Path]
    env: dict[str, str]
    project: str
    env_file: Path | None = None
    log: list[str] = field(default_factory=list)

    def __call__(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        assert COMPOSE_BIN is not None
        argv = [COMPOSE_BIN, "--no-ansi", "-p", self.project]
        for path in self.files:
            argv += ["-f", str(path)]
        if self.env_file is not None:
            argv += ["--env-file", str(self.env_file)]
        started = time.monotonic()
        run = subprocess.run(
            [*argv, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, **self.env},
        )
        took = time.monotonic() - started
        self.log.append(f"compose {' '.join(args)}: {run.returncode} in {took:.1f}s")
        if check and run.returncode != 0:
            raise RuntimeError(
                f"docker-compose {' '.join(args)} failed ({run.returncode}):\n"
                f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            )
        return run

    def docker_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.docker, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def container(self, service: str) -> str:
        """The service's one container, found by compose's labels (docker-compose itself is a
        slow Python program to start once a second)."""
        labels = {"project": self.project, "service": service}
        filters = [
            a for k, v in labels.items() for a in ("--filter", f"label=com.docker.compose.{k}={v}")
        ]
        ids = self.docker_cli("ps", "-a", "-q", *filters).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, service: str) -> dict[str, object]:
        out = self.docker_cli("inspect", "--format", "{{json .State}}", self.container(service))
        state: dict[str, object] = json.loads(out.stdout)
        return state

    def wait_for(self, service: str, what: str, timeout_s: float) -> float:
        """Wait until `service` is `healthy` (its health) or `exited` (its status)."""
        started = time.monotonic()
        while True:
            state = self.state(service)
            health = state.get("Health")
            now = health.get("Status") if isinstance(health, dict) else None
            if what in (now, state.get("Status")):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise AssertionError(
                    f"{service} not {what} after {timeout_s:.0f}s: {state}\n{self.logs(service)}"
                )
            time.sleep(1)

    def exit_code(self, service: str) -> int:
        code = self.state(service)["ExitCode"]
        assert isinstance(code, int)
        return code

    def logs(self, service: str) -> str:
        out = self.docker_cli("logs", self.container(service))
        return out.stdout + out.stderr

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=180)
