# tandem: `make run` streams an answer from the default model; `make test` runs the suite (`make test-fast`:
# ruff and tests/unit only, in process, about a minute).
VENV ?= .venv
PY := $(VENV)/bin/python
TANDEM := $(VENV)/bin/tandem
PROMPT ?= What is the capital of France?

.PHONY: setup model run test test-fast lint bench clean gpu-check

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

model: setup
	$(TANDEM) fetch-model
	$(TANDEM) build-kernels

run: model
	$(TANDEM) up --generate "$(PROMPT)"

test: model
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

test-fast: model
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .

bench: model
	$(TANDEM) bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# On a GPU machine with no network: a venv over the machine's own CUDA torch, the project and its
# dependencies (setuptools included, for the build) from WHEELS (a folder of wheels), then every check of tandem/gpu_check.py as JSON lines
# (also appended to gpu-check.jsonl).
GPU_VENV ?= .venv-gpu
WHEELS ?= wheels
gpu-check:
	python3 -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(WHEELS) -e .
	$(GPU_VENV)/bin/python -m tandem.gpu_check --device cuda --out gpu-check.jsonl
