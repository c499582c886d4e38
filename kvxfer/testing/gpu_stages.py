"""The stages of ``make gpu-check`` (``kvxfer.testing.gpu_check``): what each one is, the
process that runs it, how that process is run (its own process group, its own deadline,
killed whole at it) and what its result is, read from what it printed or wrote.

This module is standard library only, as ``gpu_check`` is: it runs in the bare machine's
Python, before the install stage has made the environment the other stages run in.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

DONE = ("ok", "dry", "unavailable")  # a later call skips these
MAX_ATTEMPTS = 2  # failed / timed-out stages: tried once more by a later call, then left


@dataclass(frozen=True)
class Stage:
    name: str
    timeout_s: float  # its own deadline
    expect_s: float  # started only with at least this much of the call's budget left
    what: str
    gpu: bool = True  # outside a dry run, needs torch to see a GPU


STAGES = (
    Stage("env", 60, 5, "driver, CUDA, GPU, NVLink/P2P, ptrace_scope, PID namespace, IMEX, pidfd_getfd",
          gpu=False),
    Stage("install", 300, 30, "what the image lacks, from the carried wheels, into .gpu-site", gpu=False),
    Stage("env-cuda", 120, 15, "torch/CUDA/NIXL/UCX versions; handle types of each pool kind"),
    Stage("tests-ipc", 300, 40, "pytest tests/test_gpu.py -k ipc"),
    Stage("tests-vmm", 300, 40, "pytest tests/test_gpu.py -k vmm"),
    Stage("bench-ipc", 420, 120, "engine cudaMalloc + legacy IPC: kvxfer/raw NIXL/copy/staged, 2 MiB-1 GiB"),
    Stage("kvxfer-bench", 420, 150, "kvxfer bench --device cuda:0 (the CLI's own comparison)"),
    Stage("lanes", 400, 60, "UCX lane of a READ and a WRITE per memory kind (UCX_PROTO_INFO=y)"),
    Stage("bench-vmm_fd", 420, 120, "VMM pools, POSIX fd: kvxfer/raw NIXL/copy/staged, 2 MiB-1 GiB"),
    Stage("bench-vmm_fabric", 420, 120, "VMM pools, fabric handle: the same, where the machine allows"),
    Stage("pd-throughput", 240, 40, "benchmarks/pd_throughput.py --device cuda:0"),
    # (281-298 s on the H200 runs: started only with that left, not started and cut)
    Stage("knobs", 420, 300, "GET_ZCOPY, MEMTYPE_CACHE, NIXL threads, chunk size, one at a time"),
)
BY_NAME = {s.name: s for s in STAGES}


# --------------------------------------------------------------------------- the stages' commands


@dataclass
class Ctx:
    repo: str
    results: str
    dry: bool
    device: str
    python: str  # the stages' interpreter (this one: the image's, with its torch)
    force: bool
    hang: frozenset[str] = frozenset()
    fail: frozenset[str] = frozenset()
    cuda_major: int | None = None

    def path(self, *p: str) -> str:
        return os.path.join(self.results, *p)


def _worker(ctx: Ctx, name: str) -> list[str]:
    cmd = [ctx.python, "-m", "kvxfer.testing.gpu_check", "--worker", name, "--result",
           ctx.path("stages", f"{name}.result.json"), "--device", ctx.device, "--results", ctx.results]
    return (cmd + (["--dry-run"] if ctx.dry else []) + (["--force"] if ctx.force else [])
            + (["--cuda-major", str(ctx.cuda_major)] if ctx.cuda_major else []))


HANG = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as fh:
    fh.write(str(child.pid))
print("hanging", flush=True)
time.sleep(600)
"""


def command(ctx: Ctx, stage: Stage) -> list[str]:
    """The process that runs ``stage``."""
    name = stage.name
    if name in ctx.hang:  # (test hook: a stage that never ends, with a child of its own)
        pidfile = ctx.path("logs", f"{name}.hang-child.pid")
        return [sys.executable, "-c", HANG, pidfile]
    if name in ctx.fail:  # (test hook: a stage that dies with a message)
        return [sys.executable, "-c", "import sys; sys.exit('the injected failure of this stage')"]
    if name in ("env", "install"):  # the bare machine's Python: nothing is installed yet
        return [sys.executable, *_worker(ctx, name)[1:]]
    if name.startswith("tests-"):
        return [ctx.python, "-m", "pytest", "tests/test_gpu.py", "-k", name.split("-", 1)[1], "-p",
                "no:cacheprovider", "-q", "-rA", f"--junitxml={ctx.path('logs', name + '.xml')}"]
    if name == "kvxfer-bench":
        if ctx.dry:  # (the CPU bench is tests/test_bench.py's; here its committed output is parsed)
            return [sys.executable, "-c", "import sys; print(open(sys.argv[1]).read().splitlines()[-1])",
                    os.path.join(ctx.repo, "benchmarks", "latest.txt")]
        return [ctx.python, "-m", "kvxfer", "bench", "--device", ctx.device, "--json"]
    if name == "pd-throughput":
        tiny = ["--device", "cpu", "--requests", "2", "--blocks-per-request", "2", "--layers", "2"]
        extra = tiny if ctx.dry else ["--device", ctx.device]
        return [ctx.python, os.path.join("benchmarks", "pd_throughput.py"), "--json", *extra]
    return _worker(ctx, name)


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    return None


def junit(path: str) -> dict[str, Any]:
    """Outcome of each test in a pytest junit file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no junit report: {e}"}
    tests = []
    for case in root.iter("testcase"):
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "") + ("\n" + (el.text or "")[-3000:] if tag != "skipped" else "")
                break
        tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": msg.strip()[:3500]})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"tests": tests, "counts": counts}


def parse(ctx: Ctx, stage: Stage, rc: int, out: str) -> dict[str, Any]:
    """A command stage's result, from what it printed or wrote; a worker's, from its file."""
    name = stage.name
    if name.startswith("tests-"):
        res = junit(ctx.path("logs", name + ".xml"))
        c = res.get("counts", {})
        if rc == 0 and c.get("passed"):
            res["status"] = "ok"
        elif rc == 0 and not c.get("failed") and not c.get("error"):
            skipped = [t["message"] for t in res.get("tests", []) if t["outcome"] == "skipped"]
            res["status"] = "dry" if ctx.dry else "unavailable"
            res["reason"] = f"every test skipped: {skipped[0] if skipped else '?'}"
        res["summary_lines"] = [f"  {c}"] + [
            f"  {t['outcome']:<8} {t['name']} ({t['seconds']:.1f} s)"
            + (f": {t['message'][:300]}" if t["outcome"] in ("failed", "error") else "")
            for t in res.get("tests", [])]
        return res
    if name in ("kvxfer-bench", "pd-throughput"):
        got = _last_json(out)
        if got is None:
            return {"error": "no JSON line in its output"}
        res = {"json": got}
        if name == "kvxfer-bench":
            res["summary_lines"] = [
                f"  {r['bytes'] >> 20} MiB: kvxfer {r['kvxfer_gbps']} raw {r['raw_nixl_gbps']} "
                f"memcpy {r['memcpy_gbps']} GB/s" for r in got.get("sizes", [])] + [
                f"  first transfer cold/warm ms: {got.get('first_transfer_ms_cold')}/"
                f"{got.get('first_transfer_ms_warm')}; memory {got.get('memory')}; "
                f"device {got.get('device')}"]
            if ctx.dry:
                res.update(status="dry", reason="not run: the committed CPU output (benchmarks/latest.txt) "
                           "was parsed; tests/test_bench.py runs the bench on CPU")
        else:
            res["summary_lines"] = [
                f"  {got.get('gbps')} GB/s over {got.get('requests')} requests of {got.get('request_bytes')} "
                f"bytes, cold first {got.get('first_transfer_ms_cold')} ms, verified {got.get('verified')} "
                f"({got.get('device')})"]
        return res
    try:
        with open(ctx.path("stages", f"{name}.result.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- running a stage


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """The stage and everything it started (sidecars, NIXL workers): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        try:
            p.wait(wait)
            if sig == signal.SIGTERM:  # (its children may linger after the leader is gone)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def stage_env(ctx: Ctx) -> dict[str, str]:
    """The checkout and the kit's packages (``.gpu-site``, once installed) first on the path."""
    from kvxfer.testing.gpu_install import pythonpath

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath(ctx.repo), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_stage(ctx: Ctx, stage: Stage, timeout: float, cut_by_budget: bool,
              prev: dict[str, Any]) -> dict[str, Any]:
    os.makedirs(ctx.path("logs"), exist_ok=True)
    out_path, err_path = ctx.path("logs", f"{stage.name}.out"), ctx.path("logs", f"{stage.name}.err")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ctx.path("stages", f"{stage.name}.result.json"))
    argv = command(ctx, stage)
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        env = {**stage_env(ctx), "KVXFER_KEEP_LOGS": ctx.path("logs", f"sidecars-{stage.name}")}
        p = subprocess.Popen(argv, stdout=fo, stderr=fe, cwd=ctx.repo, env=env,
                             start_new_session=True)  # (its own group: killed whole at its deadline)
        timed_out = False
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(p)
            rc = p.returncode if p.returncode is not None else -9
        else:
            _kill_group(p)  # (anything it left behind in its group)
    seconds = round(time.monotonic() - t0, 1)
    stdout = _tail(out_path, 200_000)
    result = parse(ctx, stage, rc, stdout)
    state: dict[str, Any] = {"name": stage.name, "what": stage.what, "started": started, "seconds": seconds,
                             "returncode": rc, "timeout_s": round(timeout, 1), "argv": argv,
                             "attempts": prev.get("attempts", 0) + 1, "result": result}
    if timed_out and cut_by_budget:
        state.update(status="pending", attempts=prev.get("attempts", 0),
                     reason=f"cut at the call's budget after {seconds} s; runs again next call")
    elif timed_out:
        state.update(status="timeout", reason=f"no end after {timeout:.0f} s: killed with its process group")
    elif rc != 0:
        state.update(status="failed", reason=f"exit code {rc}")
    else:
        state.update(status=result.get("status", "ok"), reason=result.get("reason", ""))
    if state["status"] not in ("ok", "dry"):
        state["stderr_tail"] = _tail(err_path, 4000)
        state["stdout_tail"] = stdout[-1500:]
    return state
