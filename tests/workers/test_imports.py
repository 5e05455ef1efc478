"""What the worker library and the tools may import.

The library (`workers/`, not `workers/tools/`) never imports the tools or the service (`app`);
the parts that run where torch may be absent or costly (the registry client, the lease keeper,
the plugin's settings and scheduler side) and the tools' orchestrators (the demo, the process
helpers) import neither torch, nixl nor numpy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import ROOT

pytestmark = pytest.mark.unit

TORCH_FREE = [
    "registry_client.client",
    "workers.publication",
    "workers.vllm_plugin",
    "workers.vllm_plugin.settings",
    "workers.vllm_plugin.scheduler_side",
    "workers.tools.demo",
    "workers.tools.procs",
]


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_library_imports_neither_the_tools_nor_the_service() -> None:
    library = [p for p in (ROOT / "workers").rglob("*.py") if "tools" not in p.parts]
    assert ROOT / "workers" / "publication.py" in library
    wrong = {
        str(path.relative_to(ROOT)): sorted(
            n for n in imported(path) if n.startswith(("workers.tools", "app.")) or n == "app"
        )
        for path in library
    }
    assert not {k: v for k, v in wrong.items() if v}


def test_the_torch_free_parts_import_neither_torch_nixl_nor_numpy() -> None:
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {TORCH_FREE!r}];"
        "print(sorted({'torch', 'nixl', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
