# The README's commands. Everything lives in .venv/ at the project root.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
VLLM_SETUP_LOG := .venv-vllm-setup.log
DEPLOY_LOG := .deploy-tier.log
SOURCES := app registry_client workers harness tests bench

.PHONY: run test test-tier test-vllm test-gpu vllm-env check lint types system-deps bench bench-quick demo clean

# The service alone: no torch, no nixl.
$(VENV)/.service: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

# Everything the tests need: the workers extra pins torch==2.13.0 (a local CPU build). flock:
# scripts/setup-vllm.sh may be building its editable install of this checkout at the same time.
$(VENV)/.dev: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	flock pyproject.toml $(BIN)/pip install -q -e '.[workers,etcd,router-sync,dev]'
	touch $@ $(VENV)/.service

run: $(VENV)/.service
	$(BIN)/engine-registry serve

# Debian packages the tests use as real parts (etcd server, compose parser).
system-deps:
	@bash scripts/system-deps.sh

lint: $(VENV)/.dev
	$(BIN)/ruff check $(SOURCES)
	$(BIN)/ruff format --check $(SOURCES)

types: $(VENV)/.dev
	$(BIN)/mypy

check: lint types

# Every tier but real vLLM, then real vLLM in its own environment (.venv-vllm).
# ENGINE_REGISTRY_REQUIRE_ALL=1: a tier that would skip for a missing part fails instead.
# .venv-vllm/ (scripts/setup-vllm.sh: about 100 s of downloads and unpacking from scratch) is
# made while .venv/, the Debian packages and the checks are. The deploy tier (Docker,
# namespaces, kubectl: mostly waiting, about half a core) starts once .venv/ and the packages
# are, beside the checks and then the other tiers; its output (.deploy-tier.log) after theirs.
# The main tiers run on two pytest-xdist workers, a module at a time each (--dist loadfile:
# module fixtures are made once); modules marked serial run alone (tests/conftest.py).
test:
	@bash scripts/setup-vllm.sh > $(VLLM_SETUP_LOG) 2>&1 & setup=$$!; \
	trap 'kill $$setup $${deploy:-} 2>/dev/null' INT TERM; \
	if ! $(MAKE) $(VENV)/.dev system-deps; then kill $$setup; exit 2; fi; \
	ENGINE_REGISTRY_REQUIRE_ALL=1 $(BIN)/pytest -m deploy -p no:cacheprovider \
		> $(DEPLOY_LOG) 2>&1 & deploy=$$!; \
	$(MAKE) check; made=$$?; \
	wait $$setup; vllm=$$?; cat $(VLLM_SETUP_LOG); \
	if [ $$vllm -ne 0 ]; then echo "make test: scripts/setup-vllm.sh failed (exit $$vllm), its output above"; fi; \
	if [ $$made -eq 0 ] && [ $$vllm -eq 0 ]; then \
		ENGINE_REGISTRY_REQUIRE_ALL=1 $(BIN)/pytest -m "not vllm and not deploy and not gpu" \
			-p xdist -n 2 --dist loadfile --durations=30; others=$$?; \
	else others=2; fi; \
	wait $$deploy; tier=$$?; echo "== the deploy tier, run beside the checks and tiers (exit $$tier) =="; \
	cat $(DEPLOY_LOG); [ $$others -eq 0 ] && [ $$tier -eq 0 ]
	$(MAKE) test-vllm

# One tier (a marker: pyproject.toml lists them), e.g. `make test-tier TIER=unit`.
test-tier: $(VENV)/.dev
	@test -n "$(TIER)" || { echo "name a tier: make test-tier TIER=<unit|api|store|tls|ui|faults|workers|deploy|docs|vllm|gpu>"; exit 2; }
	ENGINE_REGISTRY_REQUIRE_ALL=1 $(BIN)/pytest -m "$(TIER)"

vllm-env:
	bash scripts/setup-vllm.sh

test-vllm: $(VENV)/.dev vllm-env
	ENGINE_REGISTRY_REQUIRE_ALL=1 $(BIN)/pytest tests/workers/vllm_plugin -m vllm

# The gpu tier alone, on a host with an NVIDIA GPU: its own environment (.venv-vllm-gpu: vLLM's
# CUDA build, Mooncake), then tests/workers/vllm_plugin/test_mooncake_pd_gpu.py. Not in `test`.
test-gpu:
	bash scripts/gpu-mooncake.sh

demo: $(VENV)/.dev
	$(BIN)/engine-registry demo

bench: $(VENV)/.dev system-deps
	$(BIN)/python -m bench.run

bench-quick: $(VENV)/.dev system-deps
	$(BIN)/python -m bench.run --quick

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-gpu .mypy_cache .ruff_cache .pytest_cache *.egg-info $(VLLM_SETUP_LOG) $(DEPLOY_LOG)
