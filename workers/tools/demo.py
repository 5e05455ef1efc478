"""`engine-registry demo`: a whole PD deployment on one machine, verified byte for byte.

Starts a registry on a temporary SQLite file, a prefill TP group spread over several "nodes"
(one `torchrun --nnodes N --node-rank K` per node, all on loopback), and a decode TP group of
another size that pulls every block over NIXL and verifies it. Prints the workers' progress
while it runs and a summary at the end; exits 0 only when every byte verified.

`--engine-id-source local` reproduces the original bug instead: every node makes up its own
engine_id (vLLM before its fix), the ranks of one TP group disagree, and the registry refuses
to publish agents under ids it never issued. That run exits 1.

This orchestrator imports neither torch nor nixl: only the torchrun children do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from registry_client.tls import VARS_OF_WORKERS, ClientTLS
from workers.tools.procs import ROOT, Proc, RegistryProcess, free_port

_PRINT_LOCK = threading.Lock()


def say(message: str) -> None:
    with _PRINT_LOCK:
        print(f"[demo] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="engine-registry demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size")
    p.add_argument("--prefill-nodes", type=int, default=2, help="nodes the prefill spans")
    p.add_argument("--decode-tp", type=int, default=4, help="decode TP size")
    p.add_argument("--decode-nodes", type=int, default=1, help="nodes the decode spans")
    p.add_argument("--blocks", type=int, default=64, help="KV blocks per prefill rank")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--num-heads", type=int, default=8, help="KV heads of the model")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="verified pulls per decode rank")
    p.add_argument("--engine-id-source", choices=["registry", "local"], default="registry")
    p.add_argument("--registry", default=None, help="use this registry instead of starting one")
    p.add_argument("--ca", help="https --registry: PEM CA bundle (else WORKERS_REGISTRY_CA)")
    p.add_argument("--cert", help="client certificate, mutual TLS (else WORKERS_REGISTRY_CERT)")
    p.add_argument("--key", help="client key, mutual TLS (else WORKERS_REGISTRY_KEY)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="the whole demo's deadline")
    p.add_argument("--workdir", default=None, help="keep reports and logs here")
    p.add_argument("--quiet", action="store_true", help="no worker progress lines")
    args = p.parse_args(argv)
    for tp, nodes, what in (
        (args.prefill_tp, args.prefill_nodes, "prefill"),
        (args.decode_tp, args.decode_nodes, "decode"),
    ):
        if tp < 1 or nodes < 1 or tp % nodes:
            p.error(f"--{what}-tp {tp} must be a positive multiple of --{what}-nodes {nodes}")
        if args.num_heads % tp:
            p.error(f"--num-heads {args.num_heads} must split over --{what}-tp {tp}")
    big, small = max(args.prefill_tp, args.decode_tp), min(args.prefill_tp, args.decode_tp)
    if big % small:
        p.error("the larger TP size must be a multiple of the smaller one")
    return args


def progress(name: str) -> Callable[[str], None]:
    """Print a worker's progress lines (its `[prefill ...]`/`[decode ...]` ones), named."""

    def echo(line: str) -> None:
        if "[prefill " in line or "[decode " in line:
            with _PRINT_LOCK:
                print(f"  {name:>16} | {line.split('] ', 1)[-1]}", flush=True)

    return echo


def worker_env() -> dict[str, str]:
    return {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def spawn(name: str, cmd: list[str], workdir: Path, quiet: bool) -> Proc:
    """One torchrun node in its own process group (stopped as one: torchrun forwards SIGTERM
    to its workers), logging to `workdir/<name>.log`, its progress printed unless `quiet`."""
    env = {**os.environ, **worker_env()}
    log = workdir / f"{name}.log"
    return Proc(name, cmd, env, log, cwd=workdir, echo=None if quiet else progress(name))


def wait_all(procs: list[Proc], deadline: float) -> bool:
    while any(p.alive() for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    for p in procs:
        p.drain()
    return True


def start_registry(workdir: Path, deadline: float) -> RegistryProcess:
    """A registry on a free loopback port over a SQLite file in `workdir` (log: registry.log)."""
    registry = RegistryProcess(
        f"sqlite:///{workdir / 'registry.db'}",
        env=worker_env(),
        log_path=workdir / "registry.log",
        cwd=workdir,
        new_session=True,
        poll_s=0.1,
    )
    return registry.start(timeout_s=max(0.0, deadline - time.monotonic()))


def torchrun_cmds(
    role: str, tp: int, nodes: int, worker_args: list[str]
) -> list[tuple[str, list[str]]]:
    port = free_port()
    out = []
    for node in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--nproc-per-node",
            str(tp // nodes),
            "-m",
            f"workers.{role}",
            *worker_args,
        ]
        out.append((f"{role}-node{node}", cmd))
    return out


def load_reports(report_dir: Path, role: str) -> list[dict[str, Any]]:
    reports = [json.loads(p.read_text()) for p in sorted(report_dir.glob(f"{role}-*.json"))]
    return sorted(reports, key=lambda r: int(r["rank"]))


def summarize(args: argparse.Namespace, report_dir: Path, codes: dict[str, int | None]) -> bool:
    prefill = load_reports(report_dir, "prefill")
    decode = load_reports(report_dir, "decode")
    print("\n==== summary ====", flush=True)
    print(
        f"prefill TP {args.prefill_tp} over {args.prefill_nodes} node(s); "
        + (
            f"decode TP {args.decode_tp} over {args.decode_nodes} node(s)"
            if decode
            else "decode not started: no prefill engine to read from"
        )
    )
    for r in prefill:
        print(
            f"  prefill rank {r['rank']} node {r.get('node')}: engine_id "
            f"{r.get('engine_id', '-')} (gen {r.get('generation', '-')}) status "
            f"{r.get('status')}"
        )
    prefill_ids = {r.get("engine_id") for r in prefill}
    if len(prefill_ids) > 1:
        print(f"  !! the prefill ranks hold {len(prefill_ids)} different engine_ids: the bug")
    for error in dict.fromkeys(str(r["error"]) for r in prefill if r.get("error")):
        ranks = [r["rank"] for r in prefill if r.get("error") == error]
        print(f"  prefill ranks {ranks} report: {error}")
    total_bytes, steady_bytes, steady_s, ok = 0, 0, 0.0, bool(decode)
    for r in decode:
        rounds = r.get("rounds", [])
        hs = rounds[0]["handshake_s"] * 1000 if rounds else float("nan")
        moved = sum(x["bytes"] for x in rounds)
        verified = sum(x["verified_bytes"] for x in rounds)
        total_bytes += moved
        for x in rounds[1:] or rounds:
            steady_bytes += x["bytes"]
            steady_s += x["transfer_s"]
        good = r.get("status") == "done" and len(rounds) >= args.rounds and verified == moved
        ok = ok and good
        print(
            f"  decode rank {r['rank']}: engine_id {r.get('engine_id')} reads from "
            f"{sorted({x['engine_id'] for x in rounds})} ranks "
            f"{rounds[0]['targets'] if rounds else '-'} (heads "
            f"{'-'.join(map(str, rounds[0]['heads'])) if rounds else '-'}): handshake "
            f"{hs:.1f} ms, "
            f"{len(rounds)} rounds, {moved} bytes, {verified} verified, status "
            f"{r.get('status')}"
        )
    print(f"  exit codes: {codes}")
    if decode:
        rate = steady_bytes / steady_s / 1e6 if steady_s else 0.0
        print(
            f"  bytes moved: {total_bytes} ({total_bytes / 2**20:.1f} MiB) in "
            f"{sum(len(r.get('rounds', [])) for r in decode)} reads; throughput "
            f"{rate:.0f} MB/s (per decode rank, warm reads)"
        )
    ok = ok and all(c == 0 for c in codes.values())
    print(f"  RESULT: {'every byte verified' if ok else 'FAILED'}", flush=True)
    return ok


def run(args: argparse.Namespace, workdir: Path) -> int:
    deadline = time.monotonic() + args.timeout_s
    report_dir = workdir / "reports"
    report_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    registry: RegistryProcess | None = None
    try:
        if args.registry:
            url = args.registry
            # The workers inherit the environment: they read these (workers.launch).
            for name, value in zip(VARS_OF_WORKERS, (args.ca, args.cert, args.key), strict=True):
                if value:
                    os.environ[name] = value
            ClientTLS.from_env()  # a bad path fails here, not in every rank
        else:
            registry = start_registry(workdir, deadline)
            url = registry.url
            say(f"registry serving at {url} (store {workdir / 'registry.db'})")
        common = [
            "--registry",
            url,
            "--report-dir",
            str(report_dir),
            "--num-blocks",
            str(args.blocks),
            "--block-size",
            str(args.block_size),
            "--num-heads",
            str(args.num_heads),
            "--head-size",
            str(args.head_size),
            "--num-layers",
            str(args.num_layers),
        ]
        readers = max(1, args.decode_tp // args.prefill_tp) * args.rounds
        prefill_args = [
            *common,
            "--group-id",
            "demo-prefill",
            "--exit-after-notifs",
            str(readers),
            "--engine-id-source",
            args.engine_id_source,
            "--serve-s",
            str(args.timeout_s),
        ]
        workers: list[Proc] = []
        for name, cmd in torchrun_cmds(
            "prefill", args.prefill_tp, args.prefill_nodes, prefill_args
        ):
            say(
                f"starting {name}: torchrun ... -m workers.prefill ({args.prefill_tp} ranks "
                f"over {args.prefill_nodes} node(s))"
            )
            workers.append(spawn(name, cmd, workdir, args.quiet))
        procs.extend(workers)
        if args.engine_id_source == "local":
            say("engine ids made up per node (--engine-id-source local): expecting refusal")
            finished = wait_all(workers, deadline)
            codes = {p.name: p.popen.returncode for p in workers}
            summarize(args, report_dir, codes)
            print(
                "\nWithout the registry each node would have published its agents under "
                "its own engine_id, and a decode instance\nhandshaking with the group would "
                "fail with 'Remote NIXL agent engine ID mismatch'. The registry refused\n"
                "those ids (engine_id_mismatch, cause 'unknown': it never issued them), so "
                "no rank served under a made-up id.",
                flush=True,
            )
            if not finished:
                say("prefill did not stop before the deadline")
            return 1
        decoders: list[Proc] = []
        decode_args = [
            *common,
            "--group-id",
            "demo-decode",
            "--prefill-group",
            "demo-prefill",
            "--rounds",
            str(args.rounds),
            "--deadline-s",
            str(args.timeout_s),
        ]
        for name, cmd in torchrun_cmds("decode", args.decode_tp, args.decode_nodes, decode_args):
            say(f"starting {name}: torchrun ... -m workers.decode ({args.decode_tp} ranks)")
            decoders.append(spawn(name, cmd, workdir, args.quiet))
        procs.extend(decoders)
        if not wait_all(decoders, deadline):
            say(f"deadline of {args.timeout_s:.0f}s passed; stopping everything")
        # The prefill ranks exit once every reader reported; if a decode failed, they never
        # will, so they get a short grace and are then stopped (SIGTERM: a clean shutdown).
        if not wait_all(workers, min(deadline, time.monotonic() + 20)):
            for proc in workers:
                proc.stop()
        workers.extend(decoders)
        codes = {p.name: p.popen.returncode for p in workers}
        return 0 if summarize(args, report_dir, codes) else 1
    finally:
        for proc in reversed(procs):
            proc.stop()
        if registry is not None:
            registry.stop(grace_s=10.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        say(f"working directory {workdir}")
        return run(args, workdir)
    tmp = Path(tempfile.mkdtemp(prefix="engine-registry-demo-"))
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
