# tandem: `make run` streams an answer from the default model; `make test` runs the suite (`make test-fast`:
# ruff and tests/unit only, in process, about a minute).
VENV ?= .venv
PY := $(VENV)/bin/python
TANDEM := $(VENV)/bin/tandem
UV := $(VENV)/bin/uv
PROMPT ?= What is the capital of France?

.PHONY: setup model run test test-fast lint bench clean gpu-check

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 uv
	$(UV) pip install -q --python $(PY) -e ".[test]"
	touch $@

setup: $(VENV)/.installed

model: setup
	$(TANDEM) fetch-model
	$(TANDEM) build-kernels

run: model
	$(TANDEM) up --generate "$(PROMPT)"

test: model
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=20 tests

test-fast: model
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .

bench: model
	$(TANDEM) bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# On a GPU machine with no network: the machine's own python3 and CUDA torch (no venv: a venv over a
# venv's python would lose its packages), the project from this checkout, and what the machine lacks from
# WHEELS (a folder of wheels, installed without their pins into GPU_SITE); then every check of
# tandem/gpu_check.py as JSON lines (also appended to GPU_OUT).
WHEELS ?= wheels
GPU_SITE ?= .gpu-site
GPU_OUT ?= gpu-check.jsonl
gpu-check:
	rm -rf $(GPU_SITE) && mkdir -p $(GPU_SITE)
	if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
		python3 -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) $(WHEELS)/*.whl; fi
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
		python3 -m tandem.gpu_check --device cuda --out $(GPU_OUT)
