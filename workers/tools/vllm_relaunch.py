"""`python -m workers.tools.vllm_relaunch --rounds 20`: the real-vLLM tier's relaunch path in a
loop, counting the rounds whose PD request hangs.

Each round is what `test_relaunched_prefill_gets_a_new_generation` does: the prefill instance
(TP 2 over two nodes, plugin on, 10 s lease) is stopped, its ranks leave the registry, a new
prefill launch opens the next generation, a fresh decode (TP 1) starts, and one PD request goes
prefill -> decode with a deadline. A request that does not finish in time is a hang: the round's
logs, a `py-spy dump` of every vLLM process (when `py-spy` is in `.venv-vllm`) and decode's
NIXL state are kept in `WORKDIR/round-N/`, and the loop goes on. It prints one line per round
and a summary (rounds, hangs, the machine's CPU).

`--debug` runs vLLM with `VLLM_LOGGING_LEVEL=DEBUG` and NIXL/UCX at `info`.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
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

from workers.tools import cpu_amx
from workers.tools.vllm_launch import ROOT, VLLM_VENV, Instance, Registry, build_model, say
from workers.tools.vllm_pd import PDTimeout, complete, pd_complete
from workers.vllm_plugin.kv_watch import MARK as KV_WATCH_MARK

NOFIX = {"PYTHONPATH": str(ROOT / "tests" / "workers" / "vllm_plugin" / "nofix")}
DEBUG_ENV = {"VLLM_LOGGING_LEVEL": "DEBUG", "NIXL_LOG_LEVEL": "INFO", "UCX_LOG_LEVEL": "info"}
# VLLM_CPU_OMP_THREADS_BIND per node: (prefill node 0, node 1), (decode). "pinned" shares core 1
# between prefill's node 1 and decode (the tier's layout until it hung); "nobind" pins nothing.
BINDS = {"pinned": (("0", "1"), ("1",)), "nobind": (("nobind", "nobind"), ("nobind",))}
PROMPT = "The registry issues one engine id per launch of a tensor parallel group"


def _dump_stacks(instance: Instance, out: Path, native: bool = False) -> None:
    """`py-spy dump` of every process of the instance (its process groups), if py-spy is there
    (``native``: with native frames, for threads stuck in C)."""
    spy = VLLM_VENV / "bin" / "py-spy"
    if not spy.exists():
        (out / f"{instance.name}-stacks.txt").write_text("py-spy not installed in .venv-vllm\n")
        return
    lines: list[str] = []
    for node, pid in _pids(instance):
        dump = subprocess.run(
            [str(spy), "dump", "--native" if native else "--locals", "--pid", pid],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines.append(f"===== {node} pid {pid} =====\n{dump.stdout}{dump.stderr}")
    name = f"{instance.name}-{'native-' if native else ''}stacks.txt"
    (out / name).write_text("\n".join(lines))


def _pids(instance: Instance) -> list[tuple[str, str]]:
    """(node, pid) of every process of the instance (its nodes' process groups)."""
    found: list[tuple[str, str]] = []
    for proc in instance.procs:
        group = subprocess.run(
            ["pgrep", "-g", str(proc.popen.pid)], capture_output=True, text=True, timeout=10
        ).stdout.split()
        found.extend((proc.name, pid) for pid in group)
    return found


def _thread_states(instance: Instance, out: Path, gap_s: float = 2.0) -> None:
    """Per thread of every process: its state, where it sleeps (wchan), its system call, and
    the CPU ticks it used over ``gap_s`` (read from /proc twice; nothing attaches)."""

    def sample(pid: str) -> dict[str, tuple[str, int, str, str, str]]:
        found: dict[str, tuple[str, int, str, str, str]] = {}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                found[task.name] = (
                    stat[0],
                    int(stat[11]) + int(stat[12]),
                    (task / "comm").read_text().strip(),
                    (task / "wchan").read_text().strip(),
                    (task / "syscall").read_text().strip(),
                )
            except (OSError, IndexError, ValueError):
                continue
        return found

    pids = [pid for _, pid in _pids(instance)]
    before = {pid: sample(pid) for pid in pids}
    time.sleep(gap_s)
    lines = [f"at {time.strftime('%H:%M:%S')}: state, CPU ticks over {gap_s} s, wchan, syscall"]
    for pid in pids:
        after = sample(pid)
        for tid, (state, ticks, comm, wchan, call) in sorted(after.items()):
            used = ticks - before[pid].get(tid, (state, ticks))[1]
            lines.append(f"{pid}/{tid} {comm:16s} {state} {used:4d} {wchan:28s} {call[:60]}")
    (out / f"{instance.name}-threads.txt").write_text("\n".join(lines) + "\n")


def _gdb_stacks(instance: Instance, out: Path) -> None:
    """``gdb`` backtraces of every thread of the instance's vLLM workers, NIXL's and UCX's
    threads included. Taken first: attaching (py-spy, gdb) interrupts blocked system calls,
    and a process frozen in one moves on once attached."""
    gdb = shutil.which("gdb")
    if gdb is None:
        (out / f"{instance.name}-gdb.txt").write_text("gdb not installed\n")
        return
    for _, pid in _pids(instance):
        comm = Path(f"/proc/{pid}/comm")
        if not comm.exists() or "Worker" not in comm.read_text():
            continue
        t0 = time.strftime("%H:%M:%S")
        bt = subprocess.run(
            [gdb, "-p", pid, "-batch", "-ex", "thread apply all bt 20"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        (out / f"{instance.name}-gdb-{pid}.txt").write_text(f"at {t0}\n{bt.stdout}{bt.stderr}")


def _dump_if_slow(
    instances: Sequence[Instance], out: Path, after_s: float, done: threading.Event
) -> None:
    """The workers' native stacks (gdb), then every process's (`py-spy dump --native`), if
    the PD request is still running ``after_s`` in: what they do while a pull waits."""
    if done.wait(after_s):
        return
    out.mkdir(parents=True, exist_ok=True)
    say(f"PD request still running after {after_s:.0f} s: thread states, then stacks, into {out}")
    for instance in instances:  # first, without attaching: what the kernel says of each thread
        _thread_states(instance, out)
    for instance in instances:
        _gdb_stacks(instance, out)
    for instance in instances:
        _dump_stacks(instance, out, native=True)


def _keep(instances: Sequence[Instance | None], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for instance in instances:
        if instance is None:
            continue
        for proc in instance.procs:
            with contextlib.suppress(OSError):
                shutil.copy(proc.log_path, out / proc.log_path.name)


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`: every instance is stopped


def run(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir
    say(f"workdir {workdir}; CPU {cpu_amx.state().cpu_model}")
    model = build_model(workdir)
    registry = Registry(workdir).start()
    extra = dict(NOFIX, ENGINE_REGISTRY_TTL_S="10", **(DEBUG_ENV if args.debug else {}))
    body: dict[str, Any] = {"model": str(model), "prompt": PROMPT, "max_tokens": 8}
    body["temperature"] = 0
    prefill: Instance | None = None
    decode: Instance | None = None
    hangs: list[int] = []
    failures: list[int] = []
    try:
        for n in range(1, args.rounds + 1):
            t0 = time.monotonic()
            for running in (prefill, decode):
                if running is not None:
                    running.stop()
            prefill = Instance(
                f"prefill-r{n}",
                model,
                workdir,
                tp=2,
                nodes=2,
                cores=BINDS[args.bind][0],
                registry_url=registry.url,
                registry_token=registry.tokens.worker,
                group="prefill-0",
                role="prefill",
                extra_env=extra,
            ).start()
            up_p = prefill.wait_healthy(args.start_timeout)
            decode = Instance(
                f"decode-r{n}",
                model,
                workdir,
                cores=BINDS[args.bind][1],
                registry_url=registry.url,
                registry_token=registry.tokens.worker,
                group="decode-0",
                role="decode",
                extra_env={
                    **{k: v for k, v in extra.items() if k != "PYTHONPATH"},
                    "ENGINE_REGISTRY_KV_WAIT_WARN_S": str(args.watch_s),
                },
            ).start()
            up_d = decode.wait_healthy(args.start_timeout)
            own = complete(prefill.url, body)
            t1 = time.monotonic()
            outcome = "ok"
            finished = threading.Event()
            threading.Thread(
                target=_dump_if_slow,
                daemon=True,
                args=((prefill, decode), workdir / f"round-{n}", args.stall_s, finished),
            ).start()
            try:
                answer, _ = pd_complete(
                    prefill.url,
                    decode.url,
                    body,
                    timeout_s=args.pd_timeout,
                    decode_logs=decode.log_text,
                )
                if answer.status_code != 200:
                    outcome = f"HTTP {answer.status_code}"
                elif answer.json()["choices"][0]["text"] != own.json()["choices"][0]["text"]:
                    outcome = "text differs"
            except PDTimeout:
                outcome = "HANG"
            except httpx.HTTPError as exc:
                outcome = f"error {type(exc).__name__}"
            finished.set()
            pd_s = time.monotonic() - t1
            pulls = [
                line.split("] ", 1)[-1]
                for line in decode.log_text().splitlines()
                if KV_WATCH_MARK in line
            ]
            if pulls:
                say(f"round {n}: decode's KV-pull watch: {pulls[-1]}")
            if outcome != "ok":
                (hangs if outcome == "HANG" else failures).append(n)
                out = workdir / f"round-{n}"
                _keep((prefill, decode), out)
                for instance in (decode, prefill):
                    _dump_stacks(instance, out)
                say(f"round {n}: {outcome}; logs and stacks in {out}")
            say(
                f"round {n}: {outcome}; prefill healthy {up_p:.0f} s, decode {up_d:.0f} s, "
                f"PD {pd_s:.1f} s, round {time.monotonic() - t0:.0f} s; hangs so far "
                f"{len(hangs)}, other failures {len(failures)}"
            )
            if outcome != "ok" and args.stop_on_hang:
                break
    finally:
        for running in (prefill, decode):
            if running is not None:
                with contextlib.suppress(Exception):
                    running.stop()
        registry.stop()
    say(
        f"summary: {args.rounds} rounds planned, hangs in rounds {hangs or 'none'}, other "
        f"failures in {failures or 'none'}; CPU {cpu_amx.state().cpu_model}"
    )
    return 1 if hangs or failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m workers.tools.vllm_relaunch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--workdir", type=Path, help="logs and model (default: a temp dir, kept)")
    p.add_argument("--pd-timeout", type=float, default=60.0, help="a PD request's deadline")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--debug", action="store_true", help="vLLM DEBUG logs, NIXL/UCX info")
    p.add_argument(
        "--watch-s",
        type=float,
        default=0.001,
        help="decode logs each KV pull waiting this long, with its stage",
    )
    p.add_argument("--stop-on-hang", action="store_true")
    p.add_argument(
        "--bind",
        choices=sorted(BINDS),
        default="nobind",
        help="pin each vLLM node's threads to a core, or not",
    )
    p.add_argument(
        "--stall-s",
        type=float,
        default=8.0,
        help="gdb and py-spy stacks once a PD request runs this long",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if args.workdir is None:
        args.workdir = Path(tempfile.mkdtemp(prefix="vllm-relaunch-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
