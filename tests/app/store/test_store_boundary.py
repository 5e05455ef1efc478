"""The store is storage only: no module of ``app/store`` imports the HTTP layer, the domain or
the service's error classes; its one error is the storage-level ``Unavailable``, which the
edge answers as 503 store_unavailable (tests/app/api/test_store_unavailable.py)."""

from __future__ import annotations

import ast

import pytest

from app.core.errors import StoreUnavailable, at_edge
from app.store import Unavailable
from harness.server import ROOT

pytestmark = pytest.mark.unit

STORE = ROOT / "app" / "store"
FORBIDDEN = ("app.core.errors", "app.api", "app.registry", "app.main", "fastapi", "starlette")


def test_no_store_module_imports_http_or_the_domain() -> None:
    found = []
    modules = sorted(STORE.glob("*.py"))
    assert len(modules) > 1, f"no store modules under {STORE}"
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # a relative one resolved from app.store
                base = ["app", "store"][: 3 - node.level] if node.level else []
                module_name = ".".join([*base, *([node.module] if node.module else [])])
                names = [module_name, *(f"{module_name}.{a.name}" for a in node.names)]
            found += [f"{module.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert not found, found


def test_the_edge_answers_a_store_unavailable_as_503_and_keeps_registry_errors() -> None:
    problem = at_edge(Unavailable("etcd at h:1 did not answer within 5 s")).problem("/x")
    assert problem["status"] == 503
    assert problem["code"] == "store_unavailable"
    assert problem["detail"] == "etcd at h:1 did not answer within 5 s"
    domain = StoreUnavailable("lost too many races")
    assert at_edge(domain) is domain
    assert isinstance(domain, Unavailable)  # one class to catch, whoever gave up
