"""A real vllm-router (PD mode, fed only through its discovery address), a real smg (SGLang's
model gateway, PD mode, fed only through its worker API) and an ``engine-registry router-sync``
feeding them, as processes: for the tests, the vLLM tier and the launcher."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from workers.tools.procs import Proc, free_port, listens_on, log_tail


def _binary(name: str, pin: str) -> str:
    """``name`` beside this interpreter (the dev extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} is not installed: `pip install {pin}` (the dev extra has it; `make dev` "
            "installs it)"
        )
    return found


def vllm_router_binary() -> str:
    return _binary("vllm-router", "vllm-router==0.1.17")


SMG_PIN = "smg==1.13.0"


class _Process:
    """A `Proc` (its own process group, logging to a file) that can be started again."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.proc: Proc | None = None

    def _spawn(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = Proc(self.name, cmd, environ, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def ours(self, port: int) -> bool:
        """Whether what answers on ``port`` is this child (``listens_on``): a picked port
        someone else bound first answers too, until the child exits."""
        return self.proc is not None and listens_on(self.proc.popen.pid, port) is not False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.proc = None


class VllmRouterProcess(_Process):
    """``vllm-router --vllm-pd-disaggregation --kv-connector nixl --vllm-discovery-address``:
    no prefill or decode URL on its command line."""

    def __init__(self, workdir: Path, *, port: int | None = None, discovery: int | None = None):
        super().__init__("vllm-router", workdir / "vllm-router.log")
        self.port = port or free_port()
        self.discovery_port = discovery or free_port()
        self.metrics_port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def discovery(self) -> str:
        return f"127.0.0.1:{self.discovery_port}"

    def start(self, timeout_s: float = 30.0) -> VllmRouterProcess:
        self._spawn(
            [
                vllm_router_binary(),
                "--vllm-pd-disaggregation",
                "--kv-connector",
                "nixl",
                "--vllm-discovery-address",
                self.discovery,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                "round_robin",
                "--log-level",
                "info",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(self.metrics_port),
            ]
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()
                raise RuntimeError(f"vllm-router exited: {log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"{self.url}/liveness", timeout=1.0)
                if answer.status_code == 200 and self.ours(self.port):
                    return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"vllm-router did not serve within {timeout_s} s")


class SmgProcess(_Process):
    """``smg launch --enable-igw --pd-disaggregation`` with no worker on its command line:
    router-sync registers them through its worker API, authenticated with ``api_key`` (an
    admin key). ``--enable-igw``: with no URL at start smg 1.13 otherwise builds only its HTTP
    router, which never selects gRPC workers registered later (docs/routers.md).
    ``pd=False``: a plain (not PD) smg, for regular workers."""

    def __init__(
        self,
        workdir: Path,
        *,
        api_key: str = "smg-admin-key",
        model_path: Path | None = None,
        pd: bool = True,
        name: str = "smg",
    ) -> None:
        super().__init__(name, workdir / f"{name}.log")
        self.pd = pd
        self.port = free_port()
        self.api_key = api_key
        self.model_path = model_path  # its tokenizer, which gRPC workers need

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def workers(self) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/workers", headers=self.headers(), timeout=5.0)
        answer.raise_for_status()
        return list(answer.json()["workers"])

    def register(self, spec: dict[str, Any]) -> None:
        """``POST /workers`` (202: registration under way)."""
        answer = httpx.post(f"{self.url}/workers", json=spec, headers=self.headers(), timeout=5)
        if answer.status_code != 202:
            raise RuntimeError(f"smg refused {spec}: {answer.status_code} {answer.text}")

    def start(self, timeout_s: float = 30.0) -> SmgProcess:
        fixed = "launch --host 127.0.0.1 --policy round_robin --log-level info"
        cmd = [_binary("smg", SMG_PIN), *fixed.split(), "--port", str(self.port)]
        cmd += ["--enable-igw", *(["--pd-disaggregation"] if self.pd else [])]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--control-plane-api-keys", f"router-sync:router-sync:admin:{self.api_key}"]
        if self.model_path is not None:
            cmd += ["--model-path", str(self.model_path)]
        self._spawn(cmd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()
                raise RuntimeError(f"smg exited: {log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                self.workers()
                if self.ours(self.port):
                    return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"smg did not serve within {timeout_s} s")


class RouterSyncProcess(_Process):
    """``engine-registry router-sync`` (``python -m app router-sync``) feeding routers."""

    def __init__(
        self,
        workdir: Path,
        registry_url: str,
        routers: Sequence[str],
        *,
        token: str | None = None,
        interval_s: float = 0.5,
        python: str | None = None,
        smgs: Sequence[SmgProcess] = (),
    ) -> None:
        super().__init__("router-sync", workdir / "router-sync.log")
        self.cmd = [
            python or sys.executable,
            "-m",
            "app",
            "router-sync",
            "--url",
            registry_url,
            "--interval",
            str(interval_s),
            *[arg for address in routers for arg in ("--vllm-router", address)],
            *[arg for smg in smgs for arg in ("--smg", smg.url)],
        ]
        self.token = token
        self.env = {"REGISTRY_TOKEN": token} if token else {}
        if smgs:
            self.env["SMG_API_KEY"] = smgs[0].api_key

    def start(self) -> RouterSyncProcess:
        self._spawn(self.cmd, self.env)
        return self
