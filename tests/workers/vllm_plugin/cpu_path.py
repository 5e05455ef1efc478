"""Which CPU kernels a real-vLLM run covered (attention ISA, AMX permission per process)."""

from __future__ import annotations

import re
from typing import Any

from tests.workers.vllm_plugin.conftest import MACHINE
from workers.tools import cpu_amx
from workers.tools.vllm_launch import Instance

AMX_HELD = re.compile(r"\[vllm_serve\] pid (\d+) \(\S+\): AMX tile permission held")


def amx_holders(instance: Instance) -> list[int]:
    """Per node, how many processes said they hold AMX permission (workers.tools.vllm_serve)."""
    return [len({int(pid) for pid in AMX_HELD.findall(text)}) for text in instance.logs()]


def report_the_cpu_path(
    decode_instance: Instance,
    prefill_instance: Instance,
    prefill: dict[str, Any],
    decode: dict[str, Any],
) -> None:
    """Which attention kernel this run covered, and on AMX that every vLLM process asked.

    `attn_isa` is what vLLM's own selector returned in the workers (the plugin records it in
    the engine's compat). With `amx`, the AMX attention kernel ran in decode's first step
    after a NIXL pull: the path that dies with SIGILL when a process lacks AMX permission.
    """
    isa = str(decode.get("attn_isa", ""))
    MACHINE["attention ISA vLLM chose (decode / prefill)"] = f"{isa} / {prefill.get('attn_isa')}"
    assert isa, decode
    assert prefill.get("attn_isa") == isa, (prefill, decode)
    held = {"decode": amx_holders(decode_instance), "prefill": amx_holders(prefill_instance)}
    MACHINE["processes holding AMX permission per node"] = str(held)
    if isa == "amx":
        # Node 0: API server, engine core, worker; a headless node: its launcher and worker.
        assert held == {"decode": [3], "prefill": [3, 2]}, (held, decode_instance.tails())
    elif not cpu_amx.state().kernel_offers:
        assert held == {"decode": [0], "prefill": [0, 0]}, held  # nothing to ask for
