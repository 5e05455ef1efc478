"""Fixtures shared by every tier."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import RegistryProcess
from tests.support.faults import RECOVERY, write_recovery


@pytest.fixture
def registry_server(tmp_path: Path) -> Iterator[RegistryProcess]:
    """A real registry process on loopback over a fresh SQLite file, no tokens."""
    with RegistryProcess(
        f"sqlite:///{tmp_path / 'registry.db'}", log_path=tmp_path / "registry.log"
    ) as server:
        yield server


@pytest.fixture
def client(registry_server: RegistryProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=registry_server.url, timeout=30.0) as c:
        yield c


# -- every tier or a red run ---------------------------------------------------------------------
#
# Tiers that need a real part (etcd, root for mounts and namespaces, kubectl, compose,
# hadolint, schemathesis) skip on a developer's machine that lacks it. Under CI, or with
# ENGINE_REGISTRY_REQUIRE_ALL=1 (``make test`` sets it), such a skip is a failure naming what
# was missing, so a green run means every tier ran.


def _serve(tmp_path: Path, name: str) -> Iterator[str]:
    store = f"sqlite:///{tmp_path / f'{name}.db'}"
    with RegistryProcess(store, log_path=tmp_path / f"{name}.log") as server:
        yield server.url


@pytest.fixture
def registry_url(tmp_path: Path) -> Iterator[str]:
    """URL of a real registry process on loopback (fresh SQLite file, no tokens)."""
    yield from _serve(tmp_path, "registry")


@pytest.fixture
def other_registry_url(tmp_path: Path) -> Iterator[str]:
    """A second, unrelated registry: it never issued the first one's engine ids."""
    yield from _serve(tmp_path, "other-registry")


def require_all() -> bool:
    ci = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
    return ci or os.environ.get("ENGINE_REGISTRY_REQUIRE_ALL") == "1"


def _as_failure(report: pytest.CollectReport | pytest.TestReport) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, but every tier must run (CI or ENGINE_REGISTRY_REQUIRE_ALL=1): {reason}. "
        "Install what it names (make system-deps, the dev extra) or run as root."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and require_all() and not hasattr(report, "wasxfail"):
        _as_failure(report)


# -- one tier per test module --------------------------------------------------------------------
#
# Folders mirror the packages (tests/app/api tests app/api); the tier is a marker. The tiers are
# the markers pyproject.toml registers with a description starting "tier:"; every test module
# declares exactly one of them in ``pytestmark`` (beside timeouts and skipifs), so
# ``pytest -m <tier>`` (``make test-tier TIER=<tier>``) runs that tier and nothing else. A module
# with none or several fails collection, naming itself and the tiers.


_TIERS = pytest.StashKey[list[str]]()


def tiers(config: pytest.Config) -> list[str]:
    """The tier markers registered in the ini file (pyproject.toml), in their order (read once
    a session)."""
    if _TIERS not in config.stash:
        names = []
        for line in config.getini("markers"):
            name, _, description = str(line).partition(":")
            if description.strip().startswith("tier:"):
                names.append(name.strip())
        config.stash[_TIERS] = names
    return config.stash[_TIERS]


def tier_problem(module: pytest.Module, known: list[str]) -> str | None:
    """Why ``module`` does not declare exactly one tier, or None when it does."""
    declared = [mark.name for mark in module.own_markers if mark.name in known]
    if len(declared) == 1:
        return None
    found = f"declares {len(declared)} ({', '.join(declared)})" if declared else "declares none"
    return (
        f"{module.path}: every test module declares exactly one tier marker, and this one "
        f"{found}. Add one of {', '.join(known)} to its module-level pytestmark, e.g. "
        f"`pytestmark = pytest.mark.{known[0]}` (the tiers: pyproject.toml, "
        '[tool.pytest.ini_options] markers, descriptions starting "tier:").'
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and require_all():
        _as_failure(report)
        return
    if (
        report.passed
        and isinstance(collector, pytest.Module)
        and (known := tiers(collector.config))
    ):
        problem = tier_problem(collector, known)
        if problem is not None:
            report.outcome = "failed"
            report.longrepr = problem


# -- the fault tests' recovery times ---------------------------------------------------------------
#
# Here, not in tests/app/conftest.py: under pytest-xdist (make test) the controller collects
# nothing, so only this conftest is loaded there; each worker hands its records over at its end.


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker
        workeroutput["recovery"] = dict(RECOVERY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller: a worker ended; keep the records it made."""
    RECOVERY.update(getattr(node, "workeroutput", {}).get("recovery", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = write_recovery()
    if path is None:
        return
    terminalreporter.section("fault recovery times (seconds)")
    for name, facts in sorted(RECOVERY.items()):
        terminalreporter.write_line(f"{name}: {facts}")
    terminalreporter.write_line(f"written to {path}")


# -- serial tests under pytest-xdist -------------------------------------------------------------
#
# make test runs the main tiers on two pytest-xdist workers. A module marked ``serial`` (checks
# that time the event loop, lease clocks or torchrun groups) runs alone: each of its tests holds
# an exclusive lock, every other test a shared one. A turnstile lock taken first gives the
# exclusive one precedence, so a serial test waits for the other worker's test in hand, never
# for more. Taken before pytest-timeout starts its clock: the wait is not the test's time.
# Without xdist, nothing is locked.


def _locked(path: Path, operation: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, operation)
    return fd


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    # The worker's own config only: a pytest a test starts (tests/test_tiers.py) inherits the
    # worker's environment, and must not wait for the lock its parent holds.
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        yield
        return
    where = Path(tempfile.gettempdir()) / f"engine-registry-tests-{workerinput['testrunuid']}"
    where.mkdir(exist_ok=True)
    serial = item.get_closest_marker("serial") is not None
    turnstile = _locked(where / "turnstile", fcntl.LOCK_EX)
    try:
        held = _locked(where / "tests", fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    finally:
        os.close(turnstile)  # closing the descriptor releases its lock
    try:
        yield
    finally:
        os.close(held)
