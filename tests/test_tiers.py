"""Every test module declares exactly one tier marker (tests/conftest.py): a module with none,
or with two, fails collection naming itself and the tiers; one tier (beside a timeout) passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

MODULES = {
    # A tier on a function is not the module's tier.
    "test_no_tier.py": "import pytest\n\n@pytest.mark.unit\ndef test_it() -> None:\n    pass\n",
    "test_two_tiers.py": (
        "import pytest\n\npytestmark = [pytest.mark.unit, pytest.mark.api]\n\n"
        "def test_it() -> None:\n    pass\n"
    ),
    "test_one_tier.py": (
        "import pytest\n\npytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]\n\n"
        "def test_it() -> None:\n    pass\n"
    ),
}


def run(tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    """pytest on one module, with the project's markers (pyproject.toml) and tests/conftest.py."""
    test = tmp_path / name
    test.write_text(MODULES[name])
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "ENGINE_REGISTRY_REQUIRE_ALL"}}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(test),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_module_without_a_tier_fails_collection_naming_itself_and_the_tiers(
    tmp_path: Path,
) -> None:
    done = run(tmp_path, "test_no_tier.py")
    assert done.returncode != 0, done.stdout
    assert "ERROR collecting" in done.stdout, done.stdout
    assert f"{tmp_path / 'test_no_tier.py'}: every test module declares exactly one" in done.stdout
    assert "declares none" in done.stdout
    assert "unit, api, store, tls, ui, faults, workers, deploy, docs, vllm, gpu" in done.stdout
    assert "passed" not in done.stdout


def test_a_module_with_two_tiers_fails_collection(tmp_path: Path) -> None:
    done = run(tmp_path, "test_two_tiers.py")
    assert done.returncode != 0, done.stdout
    assert "declares 2 (unit, api)" in done.stdout, done.stdout


def test_a_module_with_one_tier_beside_a_timeout_runs(tmp_path: Path) -> None:
    done = run(tmp_path, "test_one_tier.py")
    assert done.returncode == 0, done.stdout
    assert "1 passed" in done.stdout
