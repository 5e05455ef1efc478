#!/bin/sh
# The build stage of docker/Dockerfile, in two steps so that a change of the code reinstalls
# only the project: `deps` installs what pyproject.toml asks for the project and its EXTRAS
# into /opt/venv and checks torch (`check-torch`, alone: the check); `project` installs /src
# itself (no dependencies) and checks that the service starts.
#
# EXTRAS "workers" brings torch, pinned in pyproject.toml. torch comes from TORCH_INDEX_URL
# (an extra index, asked only when the workers extra is installed) or from wherever pip's own
# settings say (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS). If the build got another
# torch than the pinned version's TORCH_BUILD (the local version after "+": cpu, cu128; empty
# accepts any), the build fails: pip falls back to PyPI's CUDA build (several GB) when the
# torch index cannot be reached. PIP_CERT_URL: a CA bundle for pip, fetched for this install
# only (it stays in no layer).
set -eu
python=/opt/venv/bin/python

project() {
    "$python" -m pip install --no-cache-dir --no-deps /src
    /opt/venv/bin/engine-registry serve --help > /dev/null
}

check_torch() {
    TORCH_BUILD="${TORCH_BUILD}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" "$python" - << 'PY'
import importlib.metadata as metadata
import os
import re
import tomllib

build = os.environ["TORCH_BUILD"]
with open("/src/pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
pin = next(r for r in extras["workers"] if re.match(r"torch\b", r))
wanted = re.search(r"==\s*([\w.]+)", pin)
assert wanted is not None, pin
found = metadata.version("torch")
public, _, local = found.partition("+")
if public != wanted[1] or (build and local != build):
    raise SystemExit(
        f"torch {found} got installed, but the image pins torch {wanted[1]}"
        f"{'+' + build if build else ''}. pip took another build: the torch index "
        f"(TORCH_INDEX_URL={os.environ['TORCH_INDEX_URL'] or 'unset'}) was unreachable or lacks "
        "it, and PyPI's default build (CUDA, several GB) came instead. Make that index "
        "reachable, or give pip the wheel (PIP_FIND_LINKS, PIP_INDEX_URL), or build with "
        "TORCH_BUILD= (empty) to accept any build of the pinned version."
    )
print(f"torch {found}: the pinned build")
PY
}

deps() {
    case ",${EXTRAS}," in
        *,workers,*) workers=1 ;;
        *) workers=0 ;;
    esac
    set --
    if [ "$workers" = 1 ] && [ -n "${TORCH_INDEX_URL}" ]; then
        set -- --extra-index-url "${TORCH_INDEX_URL}"
    fi
    if [ -n "${PIP_CERT_URL:-}" ]; then
        "$python" -c 'import sys, urllib.request; sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=60).read())' \
            "${PIP_CERT_URL}" > /tmp/pip-cert.pem
        export PIP_CERT=/tmp/pip-cert.pem
    fi
    # The project's requirements and its extras', from pyproject.toml (the code is not here yet).
    "$python" - "${EXTRAS}" > /tmp/requirements.txt << 'PY'
import sys
import tomllib

with open("/src/pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
wanted = list(project["dependencies"])
for extra in filter(None, (e.strip() for e in sys.argv[1].split(","))):
    wanted += project["optional-dependencies"][extra]
print("\n".join(wanted))
PY
    "$python" -m pip install --no-cache-dir "$@" -r /tmp/requirements.txt
    rm -f /tmp/pip-cert.pem /tmp/requirements.txt
    if [ "$workers" = 1 ]; then
        check_torch
    elif "$python" -c "import torch" 2> /dev/null; then
        echo "EXTRAS=${EXTRAS} has no workers extra, yet torch got installed" >&2
        exit 1
    fi
}

case "${1:-}" in
    deps) deps ;;
    project) project ;;
    check-torch) check_torch ;;
    *) echo "usage: $0 deps|project|check-torch" >&2; exit 2 ;;
esac
