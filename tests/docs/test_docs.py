"""The documentation against the code: links resolve inside the repository, docs/configuration.md
lists every setting and variable the code reads, docs/api.md every route and error code.

Each test fails with a message naming what is missing or wrong, and where.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
API_MD = DOCS / "api.md"
CONFIGURATION_MD = DOCS / "configuration.md"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- markdown parsing --------------------------------------------------------------------------

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker[0] * len(marker)
                continue
            if marker.startswith(fence):
                fence = None
                continue
        if fence is None:
            yield number, re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line)


_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path.read_text()):
        for pattern in (_INLINE_LINK, _REFERENCE, _HTML_LINK):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
    return found


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed
    (letters, digits, ``_`` and ``-`` kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Heading anchors (duplicates numbered -1, -2 … as GitHub does) and explicit ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence: str | None = None
    for line in path.read_text().splitlines():
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker[0] * len(marker)
            elif marker.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        heading = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        found.update(re.findall(r"""<a\s+(?:id|name)\s*=\s*["']([^"']+)["']""", line))
    return found


# -- (a) links -----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", markdown_files(), ids=rel)
def test_every_relative_link_resolves_to_a_file_inside_the_repository(doc: Path) -> None:
    problems = []
    for number, target in links(doc):
        where = f"{rel(doc)}:{number}: link {target!r}"
        parts = urlsplit(target)
        if parts.scheme or target.startswith("//"):
            if parts.scheme == "file":
                problems.append(f"{where} is a file: URL; link inside the repository instead")
            continue  # http(s), mailto: not checked here
        path_part = unquote(parts.path)
        if path_part.startswith("/"):
            problems.append(f"{where} is absolute; use a path relative to {rel(doc)}")
            continue
        if "shared/" in path_part or path_part.rstrip("/").endswith("shared"):
            problems.append(f"{where} points into shared/, which is not part of the repository")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{where} leaves the repository (resolves to {resolved})")
            continue
        if not resolved.exists():
            problems.append(f"{where}: no such file {rel(resolved)}")
            continue
        fragment = unquote(parts.fragment)
        if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{where}: {rel(resolved)} has no heading or id for #{fragment}")
    assert not problems, "broken or outside links:\n" + "\n".join(problems)


def test_the_link_checker_sees_links_and_skips_code() -> None:
    sample = ROOT / "docs" / "api.md"
    found = [target for _, target in links(sample)]
    assert "#routes" in found, "the link extractor found none of api.md's contents links"
    text = "a [x](real.md) `[y](in-code.md)`\n```\n[z](fenced.md)\n```\n[w](after.md#a)\n"
    assert [t for _, line in prose_lines(text) for t in _INLINE_LINK.findall(line)] == [
        "real.md",
        "after.md#a",
    ]
    assert github_slug("PUT /tp-groups/{group_id}/engine") == "put-tp-groupsgroup_idengine"
    assert github_slug("`wait_ready` semantics") == "wait_ready-semantics"


# -- (b) configuration -------------------------------------------------------------------------


def table_rows(path: Path, header: list[str]) -> dict[str, list[str]]:
    """Rows of the tables whose header is ``header``, keyed by their first cell (backticks
    dropped); each row as its cells."""
    rows: dict[str, list[str]] = {}
    inside = False
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line.startswith("|"):
            inside = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if [c.lower() for c in cells] == header:
            inside = True
            continue
        if inside and not set(line) <= set("|-: "):
            rows[cells[0].strip("`")] = cells
    return rows


def shown_defaults(value: object) -> set[str]:
    """How a default may be written in the docs."""
    if value is None:
        return {"none"}
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, float):
        return {f"{value:g}", repr(value)}
    return {str(value)}


def test_configuration_lists_every_service_setting_with_variable_flag_and_default() -> None:
    from app.server.settings import Settings

    rows = table_rows(CONFIGURATION_MD, ["variable", "flag", "default", "meaning"])
    problems = []
    for name, field in Settings.model_fields.items():
        variable = f"REGISTRY_{name.upper()}"
        row = rows.get(variable)
        if row is None:
            problems.append(f"setting {name!r}: no row for `{variable}` in the settings table")
            continue
        flag = f"`--{name.replace('_', '-')}`"
        if flag not in row[1]:
            problems.append(f"setting {name!r}: row `{variable}` does not name its flag {flag}")
        default = row[2].strip("`")
        if default not in shown_defaults(field.default):
            problems.append(
                f"setting {name!r}: row `{variable}` shows default {row[2]}, "
                f"the code has {field.default!r}"
            )
        if not row[3]:
            problems.append(f"setting {name!r}: row `{variable}` has no meaning")
    known = {f"REGISTRY_{name.upper()}" for name in Settings.model_fields}
    stale = sorted(v for v in rows if v.startswith("REGISTRY_") and v not in known)
    problems += [f"`{v}` is documented but is not a field of Settings" for v in stale]
    assert not problems, f"{rel(CONFIGURATION_MD)} vs app/server/settings.py:\n" + "\n".join(
        problems
    )


def worker_settings() -> list[type]:
    from workers.settings import DecodeSettings, PrefillSettings, WorkerSettings

    return [WorkerSettings, PrefillSettings, DecodeSettings]


def check_settings_table(
    classes: list[type], header: list[str], *, flags: bool, where: str
) -> list[str]:
    """Every field of ``classes`` has a row (its variable) in a table with ``header``, naming
    its flags and showing its default when it has a concrete one; no row names a variable
    that is no field."""
    from workers import config
    from workers.settings import FLAG_ALIASES

    rows = table_rows(CONFIGURATION_MD, header)
    problems, known = [], set()
    prefix = classes[0].model_config["env_prefix"]
    for cls in classes:
        for name, field in cls.model_fields.items():
            variable = config.env_name(cls, name)
            known.add(variable)
            row = rows.get(variable)
            if row is None:
                problems.append(f"{where} {cls.__name__}.{name}: no row for `{variable}`")
                continue
            for flag in config.flag_names(name, FLAG_ALIASES) if flags else []:
                if f"`{flag}`" not in row[1]:
                    problems.append(f"{where} row `{variable}` does not name its flag {flag}")
            concrete = field.default not in (None, "") and not field.is_required()
            if concrete and row[-2].strip("`") not in shown_defaults(field.default):
                problems.append(
                    f"{where} row `{variable}` shows default {row[-2]}, the code has "
                    f"{field.default!r}"
                )
            if not row[-1]:
                problems.append(f"{where} row `{variable}` has no meaning")
    stale = sorted(v for v in rows if v.startswith(prefix) and v not in known)
    problems += [f"`{v}` is documented in the {where} table but is no setting" for v in stale]
    return problems


def test_configuration_lists_every_worker_and_plugin_setting() -> None:
    from workers.vllm_plugin.settings import PluginSettings

    header = ["variable", "flag", "default", "meaning"]
    problems = check_settings_table(worker_settings(), header, flags=True, where="workers")
    plugin = ["variable", "default", "meaning"]
    problems += check_settings_table([PluginSettings], plugin, flags=False, where="plugin")
    assert not problems, f"{rel(CONFIGURATION_MD)} vs the settings classes:\n" + "\n".join(problems)


_WORKER_VARIABLE = re.compile(r"\b(?:ENGINE_REGISTRY|WORKERS)_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
_ENVIRON_GET = re.compile(r"""os\.environ(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]*)["']""")


def variables_read() -> dict[str, set[str]]:
    """Environment variables named in the code: every ENGINE_REGISTRY_*/WORKERS_* name in
    workers/, every field of the workers' and the plugin's settings classes, and every
    variable app/cli.py reads; each with the files naming it."""
    from workers import config
    from workers.vllm_plugin.settings import PluginSettings

    found: dict[str, set[str]] = {}
    for cls in [*worker_settings(), PluginSettings]:
        for name in cls.model_fields:
            found.setdefault(config.env_name(cls, name), set()).add(cls.__name__)
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for name in _WORKER_VARIABLE.findall(path.read_text()):
            found.setdefault(name, set()).add(rel(path))
    cli = ROOT / "app" / "cli.py"
    for name in _ENVIRON_GET.findall(cli.read_text()):
        found.setdefault(name, set()).add(rel(cli))
    return found


def test_configuration_names_every_variable_the_workers_and_clients_read() -> None:
    found = variables_read()
    assert "WORKERS_REGISTRY_URL" in found, found
    assert "ENGINE_REGISTRY_URL" in found, found
    text = CONFIGURATION_MD.read_text()
    missing = [
        f"`{name}` (read in {', '.join(sorted(files))})"
        for name, files in sorted(found.items())
        if f"`{name}`" not in text
    ]
    assert not missing, f"{rel(CONFIGURATION_MD)} does not document:\n" + "\n".join(missing)


_ADD_ARGUMENT = re.compile(r"""add_argument\(\s*["'](--[a-z0-9][a-z0-9-]*)["']""")


def flags_of_cli() -> dict[str, set[str]]:
    """The flags of the worker entrypoints (their settings' fields) and tools (workers/**.py),
    and of `engine-registry`'s subcommands, each with where it is defined."""
    from workers import config
    from workers.settings import FLAG_ALIASES

    found: dict[str, set[str]] = {}
    for cls in worker_settings():
        for name in cls.model_fields:
            for flag in config.flag_names(name, FLAG_ALIASES):
                found.setdefault(flag, set()).add(cls.__name__)
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for flag in _ADD_ARGUMENT.findall(path.read_text()):
            found.setdefault(flag, set()).add(rel(path))
    from app.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, parser in action.choices.items():
                for option in parser._actions:
                    for flag in option.option_strings:
                        if flag.startswith("--") and flag != "--help":
                            found.setdefault(flag, set()).add(f"engine-registry {command}")
    return found


def test_configuration_names_every_flag_of_the_entrypoints() -> None:
    found = flags_of_cli()
    assert "--group-id" in found, found
    assert "--store-timeout" in found, found
    text = CONFIGURATION_MD.read_text()
    missing = [
        f"{flag} (of {', '.join(sorted(where))})"
        for flag, where in sorted(found.items())
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    ]
    assert not missing, f"{rel(CONFIGURATION_MD)} does not document:\n" + "\n".join(missing)


# -- (c) the API reference -------------------------------------------------------------------


def test_api_reference_names_every_route_of_the_openapi_document() -> None:
    from app.main import create_app
    from app.server.settings import Settings

    app = create_app(Settings(host="127.0.0.1", tokens=None, tokens_file=None))
    paths: dict[str, dict[str, object]] = app.openapi()["paths"]
    assert "/tp-groups/{group_id}/engine" in paths, sorted(paths)
    text = API_MD.read_text()
    missing = []
    for path, operations in sorted(paths.items()):
        for method in sorted(operations):
            route = f"{method.upper()} {path}"
            if not re.search(rf"{re.escape(route)}(?![\w/{{}}-])", text):
                missing.append(route)
    assert not missing, f"{rel(API_MD)} does not describe these routes:\n" + "\n".join(missing)


def registry_error_codes() -> dict[str, tuple[int, str]]:
    """code → (status, where) for every RegistryError class with its own ``code``."""
    from app.core.errors import RegistryError

    codes: dict[str, tuple[int, str]] = {}
    pending: list[type[RegistryError]] = [RegistryError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "code" in vars(cls):
            codes[cls.code] = (cls.status, f"app/core/errors.py {cls.__name__}")
    return codes


def server_codes() -> dict[str, tuple[int, str]]:
    """code → (status, where) of the answers app/server/protocol.py writes itself
    (``self._refuse(status, reason, code, detail)``)."""
    path = ROOT / "app" / "server" / "protocol.py"
    codes: dict[str, tuple[int, str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_refuse"
            and len(node.args) >= 3
        ):
            status, code = node.args[0], node.args[2]
            if (
                isinstance(status, ast.Constant)
                and isinstance(status.value, int)
                and isinstance(code, ast.Constant)
            ):
                codes[str(code.value)] = (status.value, f"app/server/serve.py line {node.lineno}")
    return codes


def http_problem_codes() -> set[str]:
    """The codes app/api/handlers.py gives HttpProblem (wrong method, other HTTP errors)."""
    tree = ast.parse((ROOT / "app" / "api" / "handlers.py").read_text())
    codes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "code" for t in node.targets
        ):
            codes |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "HttpProblem"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            codes.add(str(node.args[1].value))
    return codes


def test_api_reference_has_a_row_for_every_error_code_with_its_status() -> None:
    codes = {**registry_error_codes(), **server_codes()}
    assert {"request_timeout", "headers_too_large", "bad_http_request"} <= codes.keys(), codes
    assert "too_many_connections" in codes, codes
    rows = table_rows(API_MD, ["code", "status", "extra members", ""])
    problems = []
    for code, (status, where) in sorted(codes.items()):
        row = rows.get(code)
        if row is None:
            problems.append(f"`{code}` ({status}, {where}): no row in the error table")
        elif row[1] != str(status):
            problems.append(f"`{code}` ({where}): the table says {row[1]}, the code {status}")
    http_codes = http_problem_codes()
    for code in sorted(http_codes - rows.keys()):
        problems.append(f"`{code}` (app/api/handlers.py HttpProblem): no row in the error table")
    for code in sorted(rows.keys() - codes.keys() - http_codes):
        problems.append(f"`{code}` is in the error table but no code answers it")
    assert not problems, f"{rel(API_MD)} error table vs the code:\n" + "\n".join(problems)


# Reference, not a diary: the README is the two commands, what and why, a curl session and
# where to read on; docs/ and bench/*.md hold the reference and the current figures (history
# lives in git).
README_BYTES = 6_500
DOCS_BYTES = 175_000


def test_the_readme_and_the_docs_stay_within_their_size() -> None:
    readme = (ROOT / "README.md").stat().st_size
    assert readme <= README_BYTES, f"README.md is {readme:,} bytes (at most {README_BYTES:,})"
    pages = sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")])
    sizes = {rel(p): p.stat().st_size for p in pages}
    total = sum(sizes.values())
    biggest = ", ".join(f"{k} {v:,}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:4])
    assert total <= DOCS_BYTES, (
        f"docs/ + bench/*.md: {total:,} bytes (at most {DOCS_BYTES:,}): {biggest}"
    )
