# The two entry points of the README. Both build .venv on first use: `make demo` installs what serving needs,
# `make test` adds the test extras. torch goes in first and alone, so that pip never swaps in another build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Which torch: the CPU build where there is no NVIDIA GPU (no nvidia-smi), PyPI's default (CUDA) build where
# there is one. pip looks for TORCH_SPEC in its own configured sources first (PyPI, any find-links folder or
# extra index in pip.conf), and only when they do not have it in TORCH_INDEX_URL (the CPU build is not on
# PyPI). Point them elsewhere, e.g.
#   make demo TORCH_SPEC=torch==2.13.0+cu128 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH_VERSION ?= 2.13.0
ifeq ($(shell command -v nvidia-smi),)
DEFAULT_TORCH_SPEC := torch==$(TORCH_VERSION)+cpu
DEFAULT_TORCH_INDEX_URL := https://download.pytorch.org/whl/cpu
TORCH_ABOUT := the CPU build, as no nvidia-smi was found: a 190 MB download, 0.85 GB installed
else
DEFAULT_TORCH_SPEC := torch==$(TORCH_VERSION)
DEFAULT_TORCH_INDEX_URL :=
TORCH_ABOUT := the CUDA build: several GB with its CUDA libraries
endif
TORCH_SPEC ?= $(DEFAULT_TORCH_SPEC)
TORCH_INDEX_URL ?= $(DEFAULT_TORCH_INDEX_URL)
ifneq ($(TORCH_SPEC),$(DEFAULT_TORCH_SPEC))
TORCH_ABOUT := as TORCH_SPEC asks
endif

.PHONY: demo test test-clients lint
demo: $(VENV)/.installed-serve
	$(BIN)/pdserve demo

# One run on pytest-xdist workers: the tests that start Ray or a server (marker `ray`, see tests/conftest.py) are one
# group that one worker runs in order on one local Ray, while the other workers take everything else (most of it
# CPU-bound Triton-interpreter kernels and models). Each test's seconds go to DURATIONS_FILE.
TEST_WORKERS ?= 4
DURATIONS_FILE ?= build/test-durations.tsv
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not gpu and not multi_gpu and not clients" -n $(TEST_WORKERS) \
		--dist loadgroup --durations=20 --durations-file=$(DURATIONS_FILE)

# The third-party clients (lm-eval, guidellm, aiperf) against the shared tiny server (marker `clients`), each run
# as a command from a virtualenv of its own, CLIENTS_VENV: their dependencies (datasets, pandas, scikit-learn,
# sanic, textual, ...) stay out of .venv. torch goes in first there too, the same build as in .venv (lm-eval
# imports it). The versions are those the tests were written against.
CLIENTS_VENV ?= .venv-clients
CLIENTS_SPEC ?= 'lm-eval[api]==0.4.13' guidellm==0.8.1 aiperf==0.13.0
test-clients: $(VENV)/.installed $(CLIENTS_VENV)/.installed
	PDSERVE_CLIENTS_VENV=$(abspath $(CLIENTS_VENV)) $(BIN)/python -m pytest -q -m clients \
		tests/frontend/test_third_party_clients.py --durations=10

$(CLIENTS_VENV)/.installed:
	$(PY) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q --upgrade pip
	@echo "==> the clients' torch ($(TORCH_SPEC), $(TORCH_ABOUT))"
	$(CLIENTS_VENV)/bin/pip install "$(TORCH_SPEC)" || { \
	  test -n "$(TORCH_INDEX_URL)" && \
	  $(CLIENTS_VENV)/bin/pip install --extra-index-url "$(TORCH_INDEX_URL)" "$(TORCH_SPEC)"; }
	@echo "==> $(CLIENTS_SPEC) (about 1.5 GB installed beside torch)"
	$(CLIENTS_VENV)/bin/pip install $(CLIENTS_SPEC)
	touch $@

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

$(VENV)/.torch:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "==> torch ($(TORCH_SPEC), $(TORCH_ABOUT))"
	$(BIN)/pip install "$(TORCH_SPEC)" || { \
	  test -n "$(TORCH_INDEX_URL)" && \
	  echo "==> $(TORCH_SPEC) is not in pip's configured sources; trying $(TORCH_INDEX_URL)" && \
	  $(BIN)/pip install --extra-index-url "$(TORCH_INDEX_URL)" "$(TORCH_SPEC)"; }
	touch $@

# What serving needs: pdserve (editable) and its dependencies.
$(VENV)/.installed-serve: $(VENV)/.torch pyproject.toml setup.py
	@echo "==> pdserve and what serving needs (ray, grpcio, protobuf, numpy, tokenizers, ...: about 0.4 GB installed)"
	$(BIN)/pip install -e .
	touch $@

# The test extras on top.
$(VENV)/.installed: $(VENV)/.installed-serve
	@echo "==> the test extras (pytest, pytest-xdist, transformers, triton, ruff, grpcio-tools: 1.2 GB installed, triton 1 GB)"
	$(BIN)/pip install -e '.[test]'
	touch $@
