# Two entry points: `make demo` (install, then run the local-cluster demo) and
# `make test` (the whole check suite CI runs). Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck layers pytest clean

# The CPU build of torch (constraints.txt pins the version): from a folder of
# wheels when one holds it, else from PyTorch's CPU index (PyPI alone would
# give the CUDA build and gigabytes of CUDA packages). Override PIP_ARGS to
# choose another source.
TORCH_WHEELS ?= /opt/wheels
PIP_ARGS ?= $(if $(wildcard $(TORCH_WHEELS)/torch-*.whl),--find-links $(TORCH_WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_ARGS) -c constraints.txt -e ".[torch,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/adaptdl demo

test: $(STAMP) lint typecheck layers pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

layers: $(STAMP)
	$(BIN)/lint-imports

pytest: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider --timeout=300

clean:
	rm -rf $(VENV) build dist src/*.egg-info
