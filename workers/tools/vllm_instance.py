"""One real vLLM instance on loopback (`Instance`): its processes (node 0 serves HTTP, the
others are headless), its flags and environment, its readiness and its logs. The building
block of `workers.tools.vllm_launch` and of the real-vLLM test tier."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from workers.tools.procs import Proc, free_port, free_port_run, listens_on
from workers.tools.vllm_procs import KV_TRANSFER_CONFIG, base_env, vllm_python


@dataclass
class Instance:
    """One vLLM instance: `nodes` processes (node 0 serves HTTP, the others are headless)."""

    name: str
    model: Path
    workdir: Path
    tp: int = 1
    nodes: int = 1
    # VLLM_CPU_OMP_THREADS_BIND per node. Not pinned by default: a decode worker pinned to a
    # prefill node's core busy-waits for its KV pull while the prefill's threads there (NIXL's
    # progress thread among them, which the READ needs) get no CPU: docs/vllm-plugin.md
    # "Starved prefill: the relaunch hang".
    cores: Sequence[str] = ("nobind",)
    registry_url: str | None = None
    registry_token: str | None = None
    group: str | None = None
    role: str | None = None
    # Per-node overrides of the plugin's environment (a misconfigured node, say).
    node_env: Sequence[Mapping[str, str]] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    master_port: int = field(default_factory=free_port)
    # Data parallelism: `dp` ranks, one per node (`nodes == dp`), each `tp` wide; node 0 runs
    # the API server and DP rank 0, node r > 0 DP rank r headless (docs/vllm-plugin.md).
    dp: int = 1
    dp_rpc_port: int = field(default_factory=free_port)
    # The connector (NixlConnector on DRAM by default) and flags added to vLLM's command line
    # (the Mooncake GPU tier: MooncakeConnector, each instance's share of the GPU's memory).
    kv_transfer_config: Mapping[str, Any] = field(default_factory=lambda: KV_TRANSFER_CONFIG)
    extra_args: Sequence[str] = ()
    procs: list[Proc] = field(default_factory=list)
    started_at: float = 0.0

    def __post_init__(self) -> None:
        if self.dp > 1:  # rank r's side channel is at base + r: all of them free
            self.side_channel_port = free_port_run(self.dp)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _cmd(self, node: int) -> list[str]:
        cmd = [
            vllm_python(),
            "-m",
            "workers.tools.vllm_serve",
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--max-num-seqs",
            "8",
            # 64 blocks of 128 tokens: enough for 8 x 512 tokens. The 1 GiB minimum of
            # VLLM_CPU_KVCACHE_SPACE would be 32k blocks, each a NIXL descriptor to register.
            "--num-gpu-blocks-override",
            "64",
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config),
            *self.extra_args,
        ]
        if self.tp > 1:
            cmd += ["-tp", str(self.tp)]
        if self.dp > 1:
            cmd += [
                "--data-parallel-size",
                str(self.dp),
                "--data-parallel-size-local",
                "1",
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(self.dp_rpc_port),
            ]
            if node > 0:
                cmd += ["--data-parallel-start-rank", str(node)]
        if self.nodes > 1:
            cmd += [
                "--nnodes",
                str(self.nodes),
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(self.master_port),
            ]
            if node > 0:
                cmd.append("--headless")
        return cmd

    def _env(self, node: int) -> dict[str, str]:
        env = base_env()
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores[node % len(self.cores)]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.registry_url:
            env["ENGINE_REGISTRY_URL"] = self.registry_url
            env["ENGINE_REGISTRY_GROUP"] = self.group or self.name
            if self.registry_token:
                env["ENGINE_REGISTRY_TOKEN"] = self.registry_token
            if self.role:
                env["ENGINE_REGISTRY_ROLE"] = self.role
        env.update(self.extra_env)
        if node < len(self.node_env):
            env.update(self.node_env[node])
        return env

    def start(self) -> Instance:
        self.started_at = time.monotonic()
        for node in range(self.nodes):
            self.procs.append(self._node_proc(node))
        return self

    def _node_proc(self, node: int, run: int = 0, env: Mapping[str, str] | None = None) -> Proc:
        suffix = f"-run{run}" if run else ""
        log = self.workdir / f"{self.name}-node{node}{suffix}.log"
        log.write_bytes(b"")
        environ = {**self._env(node), **(env or {})}
        return Proc(f"{self.name}/node{node}{suffix}", self._cmd(node), environ, log)

    def kill_node(self, node: int) -> None:
        """``kill -9`` one node's processes (a crash of that node alone)."""
        self.procs[node].signal(signal.SIGKILL)
        self.procs[node].stop(grace_s=0.0)

    def restart_node(self, node: int, run: int, env: Mapping[str, str] | None = None) -> Proc:
        """Start node `node` again, `env` added (its log: ``…-node{node}-run{run}.log``)."""
        self.procs[node] = self._node_proc(node, run, env)
        return self.procs[node]

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Seconds from start to a healthy HTTP endpoint; raises with the logs' tails if not."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{self.tails()}")
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"{self.url}/health", timeout=2.0)
                # Only then who answered: vLLM loads for minutes, /proc need not be read meanwhile.
                if answer.status_code == 200 and any(
                    listens_on(proc.popen.pid, self.port) is not False for proc in self.procs
                ):
                    return time.monotonic() - self.started_at
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy within {timeout_s} s:\n{self.tails()}")

    def wait_exit(self, timeout_s: float = 240.0) -> list[int | None]:
        """Every node's exit status (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout_s
        return [p.wait(max(0.0, deadline - time.monotonic())) for p in self.procs]

    def logs(self) -> list[str]:
        return [p.text() for p in self.procs]

    def log_text(self) -> str:
        """Every node's log, in one text."""
        return "\n".join(self.logs())

    def tails(self, n: int = 3000) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.text()[-n:]}" for p in self.procs)

    def kill(self) -> None:
        """``kill -9`` every process of every node at once (a crash: nothing deregisters)."""
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.stop(grace_s=0.0)
        self.procs = []

    def stop(self) -> None:
        # Headless nodes first would leave node 0 waiting in a collective; stop all at once.
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop(grace_s=15.0)
        self.procs = []


# -- the one-command try-out ----------------------------------------------------------------
