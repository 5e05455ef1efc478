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


# A worker's publication, top to bottom: the entrypoints' launch, the per-node publication,
# the lease keepers, the keep-alive stream. The endpoint (NIXL's data path) is beside them:
# launch describes the agent with it, then hands the description down as a value.
PUBLICATION_LAYERS = ["launch", "node", "publication", "keepalive"]


def test_a_publication_goes_one_way_down() -> None:
    upward = []
    for i, name in enumerate(PUBLICATION_LAYERS):
        above = {f"workers.{m}" for m in PUBLICATION_LAYERS[:i]}
        if name != "launch":
            above.add("workers.endpoint")  # only launch reaches the data path
        found = imported(ROOT / "workers" / f"{name}.py")
        upward += [f"workers.{name} imports {n}" for n in sorted(found & above)]
    endpoint = imported(ROOT / "workers" / "endpoint.py")
    upward += [
        f"workers.endpoint imports {n}"
        for n in sorted(endpoint)
        if n in {f"workers.{m}" for m in PUBLICATION_LAYERS}
    ]
    assert not upward, upward
    # The node's publication takes this rank's agent as a value, not a callback into launch.
    tree = ast.parse((ROOT / "workers" / "node.py").read_text())
    per_node = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "publish_per_node"
    )
    hints = [ast.unparse(a.annotation) for a in per_node.args.args if a.annotation is not None]
    assert not [h for h in hints if "Callable[[], AgentItem]" in h], hints
