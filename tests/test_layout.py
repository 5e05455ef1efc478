"""The package map in docs/development.md ("Layout") is the code's: every import of every
module (lazy ones and ``TYPE_CHECKING`` ones included) goes to its own package or to one its
row names; no two files import each other, directly or in a ring; ``app``'s root holds its
entry points only; ``bench`` imports nothing from ``tests``."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("app", "registry_client", "workers", "bench", "harness")
FIRST_PARTY = (*TOPS, "tests")
ROW = re.compile(r"^\| `([\w.]+)` \|.*\| ([^|]*) \|$")


def package_map() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in layout.splitlines():
        if m := ROW.match(line):
            rows[m.group(1)] = set(re.findall(r"`([\w.*]+)`", m.group(2)))
    return rows


def modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> Iterator[str]:
    """Every absolute import of a module, as the dotted names it reaches."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{a.name}" for a in node.names)


def owner(name: str, packages: set[str]) -> str | None:
    """The package of the map a module belongs to: the longest row that prefixes it."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in packages:
            return ".".join(parts[:end])
    return None


def allowed(target: str, row: set[str]) -> bool:
    return any(target == a or (a.endswith(".*") and target.startswith(a[:-1])) for a in row)


def test_every_package_has_a_row_and_every_import_goes_where_its_row_says() -> None:
    rows = package_map()
    assert {"app", "app.store", "registry_client", "workers", "bench", "harness"} <= set(rows)
    found = modules()
    wrong: list[str] = []
    for name, path in sorted(found.items()):
        mine = owner(name, set(rows))
        assert mine is not None, f"{name}: no row of docs/development.md's package map owns it"
        for target in imports(path):
            if target.split(".")[0] not in FIRST_PARTY:
                continue
            if target.split(".")[0] == "tests":
                wrong.append(f"{name} imports {target}: tests/ is for tests only")
                continue
            theirs = owner(target, set(rows))
            if theirs is None or theirs == mine or mine == "bench":
                continue
            if not allowed(theirs, rows[mine]):
                wrong.append(f"{name} ({mine}) imports {target} ({theirs}), not in its row")
    assert not wrong, "\n".join(wrong)


def test_no_two_files_import_each_other_directly_or_in_a_ring() -> None:
    found = modules()
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        edges = set()
        for target in imports(path):
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    rings = strongly_connected(graph)
    assert not rings, "import cycles: " + "; ".join(" <-> ".join(r) for r in rings)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    rings: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    ring = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        ring.append(member)
                        if member == node:
                            break
                    if len(ring) > 1:
                        rings.append(sorted(ring))
    return rings


def test_the_cycle_finder_finds_a_ring() -> None:
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(ring) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_service_imports_nothing_of_the_workers() -> None:
    """Whatever the map says: ``app`` reaches the worker library only by running it (the
    demo is ``python -m workers.tools.demo``), never by an import."""
    wrong = [
        f"{name} imports {target}"
        for name, path in sorted(modules().items())
        if name.split(".")[0] == "app"
        for target in imports(path)
        if target.split(".")[0] == "workers"
    ]
    assert not wrong, wrong


def test_apps_root_holds_its_entry_points_only() -> None:
    root = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(root) <= 4, root


# Functions over 80 lines left in app/ (none; the list only shrinks).
LONG_FUNCTIONS_LEFT: set[str] = set()


def test_no_function_in_app_is_over_80_lines_and_create_app_is_60_at_most() -> None:
    long: set[str] = set()
    for path in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{path.relative_to(ROOT)}:{node.name}"
                if lines > 80 or (name == "app/main.py:create_app" and lines > 60):
                    long.add(f"{name} ({lines} lines)")
    assert {n.split(" ")[0] for n in long} <= LONG_FUNCTIONS_LEFT, sorted(long)


# uvicorn's documented interface: the package's `run`, `Config` and `Server` (and the options
# they take). Its modules (`uvicorn.protocols.*`, `uvicorn.server`, `uvicorn.config`,
# `uvicorn.lifespan.*`, `uvicorn._types`, ...) are its internals: they change between minor
# releases. Only the connection's protocols may build on them (pyproject.toml pins the minor
# release): the limits both paths keep (`protocol`, `websocket`) and the measured fast path's
# protocols (`bypass.wire`, `bypass.hot`, `bypass.keepalive_wire`). bench/ drives the server's
# own pieces in one process to measure them, so it is not held to this.
UVICORN_PUBLIC = {"uvicorn", "uvicorn.run", "uvicorn.Config", "uvicorn.Server"}
UVICORN_INTERNALS_IN = {
    "app.server.protocol",
    "app.server.websocket",
    "app.server.bypass.wire",
    "app.server.bypass.hot",
    "app.server.bypass.keepalive_wire",
}


def private_uvicorn(path: Path) -> list[str]:
    """The imports of uvicorn's internals in ``path``: anything beyond ``UVICORN_PUBLIC``."""
    return [
        target
        for target in imports(path)
        if target.split(".")[0] == "uvicorn" and target not in UVICORN_PUBLIC
    ]


def test_only_the_connections_protocols_import_uvicorns_internals() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, path in sorted(modules().items())
        if not name.startswith("bench") and name not in UVICORN_INTERNALS_IN
        for target in private_uvicorn(path)
    ]
    assert not wrong, "uvicorn's internals outside the connection's protocols:\n" + "\n".join(wrong)


def test_the_uvicorn_rule_sees_lazy_and_private_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import uvicorn\nfrom uvicorn import Config\n"
        "def f():\n    from uvicorn.server import ServerState\n    import uvicorn._types\n"
    )
    assert private_uvicorn(source) == ["uvicorn.server.ServerState", "uvicorn._types"]
