# Two entry points: `make demo` (install, then run the local-cluster demo) and
# `make test` (the whole check suite CI runs). Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck layers pytest clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[torch,dev]"
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
