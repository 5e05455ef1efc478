"""The documented Python snippets: every ```python block of README.md and docs/*.md parses, and
each one a page marks to run (```python run) runs as written, in its own interpreter, against
a real registry serving mutual TLS with tokens: the files it names (``pki/ca.pem``,
``pki/client.crt``, ``pki/client.key``) lie in its working directory and the workers'
variables (``WORKERS_REGISTRY_URL``, ``_TOKEN``, ``_CA``, ``_CERT``, ``_KEY``) name them.
Blocks not marked need what a test cannot give as written (a vLLM config, a TP group, a
stream read forever)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.pki import Pki
from harness.server import ROOT, RegistryProcess

pytestmark = pytest.mark.docs

WORKER = "worker-token-snippets-4b1e9d"
_OPEN = re.compile(r"^(`{3,})python(?:\s+(\w+))?\s*$")


@dataclass(frozen=True)
class Snippet:
    where: str  # page:line
    run: bool
    code: str


def snippets() -> list[Snippet]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines()
        number = 0
        while number < len(lines):
            match = _OPEN.match(lines[number])
            number += 1
            if match is None:
                continue
            start, body = number, []
            while number < len(lines) and not lines[number].startswith(match.group(1)):
                body.append(lines[number])
                number += 1
            where = f"{page.relative_to(ROOT)}:{start}"
            found.append(Snippet(where, match.group(2) == "run", "\n".join(body) + "\n"))
    return found


SNIPPETS = snippets()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_every_python_snippet_parses(snippet: Snippet) -> None:
    ast.parse(snippet.code, filename=snippet.where)


def test_the_pages_mark_snippets_to_run() -> None:
    assert [s.where for s in SNIPPETS if s.run], "no ```python run block left in the docs"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegistryProcess, Pki]]:
    where = tmp_path_factory.mktemp("snippets")
    pki = Pki.make(where / "made")
    tokens = where / "tokens"
    tokens.write_text(f"worker:{WORKER}\n")
    with RegistryProcess(
        f"sqlite:///{where / 'registry.db'}",
        args=["--tokens-file", str(tokens)],
        tls=pki.mutual(),
        log_path=where / "registry.log",
    ) as proc:
        yield proc, pki


@pytest.mark.timeout(120)
@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.run], ids=lambda s: s.where)
def test_a_snippet_marked_to_run_runs_as_written(
    snippet: Snippet, registry: tuple[RegistryProcess, Pki], tmp_path: Path
) -> None:
    proc, pki = registry
    (tmp_path / "pki").mkdir()
    for made, named in ((pki.ca, "ca.pem"), (pki.client_cert, "client.crt")):
        shutil.copy(made, tmp_path / "pki" / named)
    shutil.copy(pki.client_key, tmp_path / "pki" / "client.key")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WORKERS_REGISTRY_URL": proc.url,
        "WORKERS_REGISTRY_TOKEN": WORKER,
        "WORKERS_REGISTRY_CA": "pki/ca.pem",
        "WORKERS_REGISTRY_CERT": "pki/client.crt",
        "WORKERS_REGISTRY_KEY": "pki/client.key",
    }
    done = subprocess.run(
        [sys.executable, "-c", snippet.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, f"{snippet.where} failed:\n{done.stderr[-3000:]}"
