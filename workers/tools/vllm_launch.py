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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from workers.tools.procs import ROOT, Proc, free_port
from workers.tools.routers import RouterSyncProcess, VllmRouterProcess
from workers.tools.vllm_instance import Instance
from workers.tools.vllm_pd import Proxy, nixl_transfers
from workers.tools.vllm_procs import (
    KV_TRANSFER_CONFIG,
    ROLES,
    VLLM_VENV,
    Registry,
    Tokens,
    base_env,
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
