# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (CPU torch first, so pip never
# resolves a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvxfer-installed
PIP_QUIET ?= -q

.PHONY: install install-vllm demo bench test lint proto clean

VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_VERSION ?= 0.33.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_QUIET) torch==2.13.0
	$(BIN)/pip install $(PIP_QUIET) -e '.[dev]'
	touch $(STAMP)

# vLLM for the connector tests, CPU-only: its wheel pins a CUDA torch, so it goes in with
# --no-deps next to the CPU torch, plus the exact modules it imports (never `pip install vllm`).
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	$(BIN)/pip install $(PIP_QUIET) --no-deps -r requirements-vllm-cpu.txt
	$(BIN)/pip install $(PIP_QUIET) --no-deps vllm==$(VLLM_VERSION)
	touch $(VLLM_STAMP)

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvxfer demo $(DEMO_ARGS)

# Side by side: kvxfer vs raw NIXL vs memcpy (+ step overhead, first transfer, scale).
bench: $(STAMP)
	$(BIN)/pip install $(PIP_QUIET) -e '.[bench]'
	$(BIN)/kvxfer bench --plot benchmarks/latest.png --json $(BENCH_ARGS) | tee benchmarks/latest.txt

# Regenerate the gRPC stubs with the pinned grpcio-tools (the output is committed;
# tests/test_control.py fails when it is stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/kvxfer/control/v1/control.proto

lint: $(STAMP)
	$(BIN)/ruff check kvxfer tests benchmarks

test: $(STAMP) $(VLLM_STAMP) lint
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
