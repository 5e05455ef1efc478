"""`python -m workers.tools.vllm_launch`: a PD deployment of real vLLM from one command,
on loopback.

Starts, in `.venv-vllm` (scripts/setup-vllm.sh):

1. a registry (`python -m app serve`, SQLite in a temporary directory);
2. a prefill instance over two headless-style nodes (`-tp 2 --nnodes 2`, node 1 `--headless`);
3. a decode instance (TP 1);
4. a router on `--proxy-port`: a real vllm-router (PD mode) that learns both instances from
   the registry through `engine-registry router-sync` (no instance URL on its command line),
   when vllm-router is installed and the registry is on; else a small proxy given the two URLs
   (as vLLM's `toy_proxy_server.py`). Either sends each `/v1/completions` request to prefill
   with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`, then to decode with
   the `kv_transfer_params` prefill answered, so decode pulls the KV over NIXL;

with the tiny Llama built offline (`workers.tools.vllm_model`), NixlConnector with its KV buffer in
DRAM, and the engine-registry vLLM plugin active on every instance (`--no-registry` leaves it
dormant). It sends one request through the proxy, prints the registry's view, and serves until
Ctrl-C (`--once`: exits after that request). Every child runs in its own process group and is
killed on exit.

The classes here are the building blocks of the real-vLLM test tier (marker `vllm`,
tests/workers/vllm_plugin/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from workers.tools.procs import ROOT, Proc, free_port
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess
from workers.tools.vllm_pd import Proxy, nixl_transfers
from workers.tools.vllm_procs import (
    KV_TRANSFER_CONFIG,
    ROLES,
    VLLM_VENV,
    Registry,
    Tokens,
    base_env,
    free_port_run,
    say,
    vllm_python,
)

__all__ = [
    "KV_TRANSFER_CONFIG",
    "ROLES",
    "ROOT",
    "VLLM_VENV",
    "Instance",
    "Proc",
    "Registry",
    "Tokens",
    "base_env",
    "build_model",
    "free_port",
    "main",
    "say",
    "vllm_python",
]


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
            json.dumps(KV_TRANSFER_CONFIG),
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
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
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


def build_model(workdir: Path) -> Path:
    """The tiny Llama, built by the vLLM environment's interpreter (it has transformers)."""
    path = workdir / "tiny-llama"
    subprocess.run(
        [vllm_python(), "-m", "workers.tools.vllm_model", str(path)],
        cwd=ROOT,
        env=base_env(),
        check=True,
        timeout=300,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return path


def show_registry(registry: Registry) -> None:
    answer = httpx.get(f"{registry.url}/tp-groups", headers=registry.headers(), timeout=5.0)
    groups = answer.json()["groups"]
    for g in groups:
        say(
            f"registry: group {g['group_id']} generation {g['generation']} engine "
            f"{g['engine_id']} role {g['role']} ranks live {g['registered_ranks']}"
            f"/{g['tp_size']} ready={g['ready']}"
        )


class _Front:
    """vllm-router fed by router-sync, as one thing to stop."""

    def __init__(self, router: VllmRouterProcess, sync: RouterSyncProcess) -> None:
        self.router, self.sync, self.url = router, sync, router.url

    def stop(self) -> None:
        self.sync.stop()
        self.router.stop()


def front(
    registry: Registry | None, prefill: Instance, decode: Instance, port: int, workdir: Path
) -> _Front | Proxy:
    """With a registry and vllm-router installed, a real vllm-router that learns both
    instances from the registry (router-sync); else the small proxy given their URLs."""
    if registry is not None:
        try:
            router = VllmRouterProcess(workdir, port=port).start()
        except FileNotFoundError as exc:
            say(f"{exc}: using the small proxy instead")
        else:
            sync = RouterSyncProcess(
                workdir, registry.url, [router.discovery], token=registry.tokens.reader
            ).start()
            say("vllm-router fed by engine-registry router-sync (no instance URL given to it)")
            return _Front(router, sync)
    return Proxy(prefill.url, decode.url, port, decode_logs=decode.log_text).start()


def first_answer(url: str, body: dict[str, Any], limit_s: float = 60.0) -> httpx.Response:
    """The first answer that is not 503 (a router answers 503 until it knows its instances)."""
    deadline = time.monotonic() + limit_s
    while True:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m workers.tools.vllm_launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", type=Path, help="logs, model, registry db (default: a temp dir)")
    p.add_argument("--proxy-port", type=int, default=8000)
    p.add_argument("--prompt", default="The registry issues one engine id per launch")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-registry", action="store_true", help="leave the plugin dormant")
    p.add_argument("--once", action="store_true", help="exit after the first request")
    p.add_argument("--timeout", type=float, default=300.0, help="start-up limit, seconds")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="vllm-launch-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    say(f"workdir {workdir} (logs: *.log)")
    started: list[Any] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        t0 = time.monotonic()
        model = build_model(workdir)
        say(f"model built in {time.monotonic() - t0:.1f} s: {model}")
        registry = None
        if not args.no_registry:
            registry = Registry(workdir).start()
            started.append(registry)
            say(f"registry {registry.url}")
        url = registry.url if registry else None
        token = registry.tokens.worker if registry else None
        prefill = Instance(
            "prefill",
            model,
            workdir,
            tp=2,
            nodes=2,
            registry_url=url,
            registry_token=token,
            group="prefill-0",
            role="prefill",
        ).start()
        started.append(prefill)
        decode = Instance(
            "decode",
            model,
            workdir,
            registry_url=url,
            registry_token=token,
            group="decode-0",
            role="decode",
        ).start()
        started.append(decode)
        say("prefill (TP 2 over two nodes) and decode (TP 1) starting...")
        say(f"prefill healthy after {prefill.wait_healthy(args.timeout):.1f} s: {prefill.url}")
        say(f"decode healthy after {decode.wait_healthy(args.timeout):.1f} s: {decode.url}")
        proxy = front(registry, prefill, decode, args.proxy_port, workdir)
        started.append(proxy)
        say(f"proxy {proxy.url}/v1/completions")
        body = {
            "model": str(model),
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        t1 = time.monotonic()
        answer = first_answer(proxy.url, body)
        say(f"PD request: {answer.status_code} in {time.monotonic() - t1:.2f} s")
        if answer.status_code != 200:
            say(answer.text[-6000:])
            return 1
        say(f"text: {answer.json()['choices'][0]['text']!r}")
        warm = []
        for _ in range(3):
            t2 = time.monotonic()
            httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=120.0).raise_for_status()
            warm.append(time.monotonic() - t2)
        say(f"PD request, warm (NIXL handshake done): median {sorted(warm)[1]:.2f} s of 3")
        say(f"decode NIXL transfers: {nixl_transfers(decode.url):.0f}")
        if registry is not None:
            show_registry(registry)
        if args.once:
            return 0
        say(
            f"serving; try: curl -s {proxy.url}/v1/completions -H 'content-type: "
            f"application/json' -d '{json.dumps(body)}'   (Ctrl-C stops everything)"
        )
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(1.0):
                pass
        return 0
    finally:
        for item in reversed(started):
            with contextlib.suppress(Exception):
                item.stop()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
