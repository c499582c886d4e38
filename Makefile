# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (CPU torch first, so pip never
# resolves a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvxfer-installed
PIP_QUIET ?= -q

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_QUIET) torch==2.13.0
	$(BIN)/pip install $(PIP_QUIET) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvxfer demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kvxfer tests benchmarks

test: $(STAMP) lint
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
