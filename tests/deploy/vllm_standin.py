"""The `vllm` of the test pods: the workers' torchrun entrypoints standing in for vLLM.

vLLM cannot run here (no GPUs; its CPU build takes minutes to start), so the topology test puts
this program first on the pods' PATH as `vllm`. It reads exactly what the rendered pod gives
vLLM, `vllm serve MODEL --tensor-parallel-size T [--nnodes N --node-rank R --master-addr A
--master-port P] [--headless]` and the plugin's ENGINE_REGISTRY_* variables, and starts what
those mean for the TP group: `torchrun` with the same rendezvous, T/N ranks on this pod, each
running `workers.prefill` or `workers.decode` (by ENGINE_REGISTRY_ROLE) on the group
ENGINE_REGISTRY_GROUP. Like the plugin, the first process of a launch fixes the launch id
(ENGINE_REGISTRY_LAUNCH_ID when the pod sets it) and TP rank 0 opens the engine with it; ranks
advertise VLLM_NIXL_SIDE_CHANNEL_HOST, the address the plugin registers.

What vLLM's proxy would decide (which prefill group a decode reads, how many rounds) comes from
STANDIN_* variables the test adds; they never appear in the manifests.

    vllm serve ...                          (this module, as `python -m tests.deploy.vllm_standin`)
    python -m tests.deploy.vllm_standin rank prefill|decode ARGS   (one rank, under torchrun)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import uuid
from pathlib import Path


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm (stand-in)")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-transfer-config", default="{}")
    return parser.parse_args(argv)


def torchrun_argv(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    """The torchrun command standing for this pod's part of the vLLM instance."""
    if args.tensor_parallel_size % args.nnodes:
        raise SystemExit(
            f"vllm stand-in: --tensor-parallel-size {args.tensor_parallel_size} is not a "
            f"multiple of --nnodes {args.nnodes}"
        )
    if args.nnodes > 1 and args.headless != (args.node_rank != 0):
        raise SystemExit(
            f"vllm stand-in: node rank {args.node_rank} with headless={args.headless}: "
            "vLLM runs its API server on node 0 and --headless on every other node"
        )
    role = env["ENGINE_REGISTRY_ROLE"]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun, f"--nproc-per-node={args.tensor_parallel_size // args.nnodes}"]
    if args.nnodes > 1:
        argv += [
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}",
        ]
    else:
        argv += ["--standalone"]
    argv += [
        "-m",
        "tests.deploy.vllm_standin",
        "rank",
        role,
        f"--group-id={env['ENGINE_REGISTRY_GROUP']}",
        f"--model={args.model}",
        f"--ttl-s={env.get('ENGINE_REGISTRY_TTL_S', '30')}",
    ]
    if env.get("STANDIN_REPORT_DIR"):
        argv.append(f"--report-dir={env['STANDIN_REPORT_DIR']}")
    if role == "prefill":
        argv.append("--serve-s=600")
    elif role == "decode":
        argv += [
            f"--prefill-group={env['STANDIN_PREFILL_GROUP']}",
            f"--rounds={env.get('STANDIN_DECODE_ROUNDS', '2')}",
            f"--until-engines={env.get('STANDIN_DECODE_ENGINES', '1')}",
            "--round-interval-s=0.5",
            "--deadline-s=150",
        ]
    else:
        raise SystemExit(f"vllm stand-in: ENGINE_REGISTRY_ROLE={role!r}: prefill or decode")
    return argv


def serve(argv: list[str]) -> int:
    args = serve_args(argv)
    env = dict(os.environ)
    # The plugin's first process names the launch; its children inherit it.
    env.setdefault("ENGINE_REGISTRY_LAUNCH_ID", uuid.uuid4().hex)
    env["WORKERS_REGISTRY_URL"] = env["ENGINE_REGISTRY_URL"]
    env["WORKERS_REGISTRY_TOKEN"] = env.get("ENGINE_REGISTRY_TOKEN", "")
    env["WORKERS_ADVERTISE_HOST"] = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    command = torchrun_argv(args, env)
    print("vllm stand-in:", " ".join(command), flush=True)
    os.execve(command[0], command, env)


def rank(argv: list[str]) -> int:
    """One TP rank: the workers' entrypoint, opening the engine with the launch's id."""
    from workers import decode, launch, prefill

    launch_id = os.environ["ENGINE_REGISTRY_LAUNCH_ID"]
    launch.sync_engine_id = functools.partial(launch.sync_engine_id, launch_id=launch_id)
    role, rest = argv[0], argv[1:]
    return prefill.main(rest) if role == "prefill" else decode.main(rest)


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        sys.exit(rank(sys.argv[2:]))
    sys.exit(serve(sys.argv[1:]))
