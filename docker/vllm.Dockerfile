# vLLM (PyPI's CUDA build) with this project's general plugin, for the Kubernetes manifests
# (deploy/k8s). A file of its own: the classic builder builds every stage of a Dockerfile up
# to the target, so in docker/Dockerfile these stages would be built by every default build.
#
#   docker build -f docker/vllm.Dockerfile -t engine-registry-vllm:0.1.0 .
#
# VLLM_VERSION must be one the plugin supports (workers/vllm_plugin SUPPORTED_VLLM_VERSIONS).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS vllm-build
ARG VLLM_VERSION=0.32.0
ARG NIXL_VERSION=1.5.1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY registry_client ./registry_client
COPY workers ./workers
# vLLM brings its own torch; the project comes without extras (its `workers` extra pins the
# CPU torch of the default image). The entry point check fails the build if vLLM would not
# load the plugin.
RUN /opt/venv/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" "nixl==${NIXL_VERSION}" /src \
 && /opt/venv/bin/python -c "import importlib.metadata as m; assert 'workers.vllm_plugin:register' in [e.value for e in m.entry_points(group='vllm.general_plugins')]"

FROM ${PYTHON_IMAGE} AS vllm
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libstdc++6 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 registry \
 && useradd --system --uid 10001 --gid registry --home-dir /data --shell /usr/sbin/nologin registry \
 && mkdir -p /data \
 && chown registry:registry /data
COPY --from=vllm-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/data
WORKDIR /data
USER 10001:10001
CMD ["vllm", "--help"]
