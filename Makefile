# The two entry points of the README. Both build .venv on first use (torch's CPU wheel first, so pip never pulls
# the CUDA build), then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint
demo: $(VENV)/.installed
	$(BIN)/pdserve demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not gpu and not multi_gpu"

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@
