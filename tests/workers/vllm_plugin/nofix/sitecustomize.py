"""Test only: make this vLLM behave as one before its engine_id fix.

Put this directory on PYTHONPATH of a vLLM launch: in every process of it (API server, engine
core, workers) vLLM's `_sync_engine_id_across_tp` becomes a no-op as soon as its module loads,
so each node of a multi-node TP group keeps the engine_id it made up when it parsed the CLI.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "vllm.distributed.kv_transfer.kv_transfer_state"


def _no_sync(vllm_config: Any) -> None:
    return None


class _BeforeTheFix(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def patched(module: ModuleType) -> None:
            exec_module(module)
            module._sync_engine_id_across_tp = _no_sync  # type: ignore[attr-defined]
            print(f"[nofix] {TARGET}._sync_engine_id_across_tp is a no-op", file=sys.stderr)

        loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _BeforeTheFix())
