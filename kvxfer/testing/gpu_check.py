"""``make gpu-check``: everything we want to know from a GPU, in one unattended command.

    python3 -m kvxfer.testing.gpu_check [--out DIR] [--budget-s 480] [--force] [--only a,b] [--dry-run]

Stages, each its own process with its own deadline, each writing
``<results>/stages/<name>.json`` before the next one starts:

==============  ==============================================================================
env             machine facts, standard library only (``gpu_probe.env_basic``)
install         ``.gpu-site``: what the image lacks, from ``.gpu-wheels`` (``gpu_install``)
env-cuda        torch/CUDA/NIXL/UCX versions, pointer attributes of each pool kind (``gpu_probe``)
tests-ipc       ``pytest tests/test_gpu.py -k ipc``
tests-vmm       ``pytest tests/test_gpu.py -k vmm``
lanes           the UCX lane of a READ and a WRITE per memory kind (``UCX_PROTO_INFO=y``)
bench-<kind>    kvxfer vs raw NIXL vs same-GPU copy vs staged, 2 MiB .. 1 GiB, both layouts,
                for ``ipc``, ``vmm_fd`` and ``vmm_fabric`` (``gpu_xfer``)
knobs           one knob at a time: GET_ZCOPY, MEMTYPE_CACHE, NIXL threads, chunk size
kvxfer-bench    ``kvxfer bench --device cuda:0 --json``
pd-throughput   ``benchmarks/pd_throughput.py --device cuda:0 --json``
==============  ==============================================================================

A stage that fails or outlives its deadline is recorded (status, exit code, the tail of its
stderr, whatever partial result it wrote) and the next one runs; its whole process group is
killed, sidecars and NIXL workers included. A call stops starting stages once its time
budget (``--budget-s``, 8 minutes) is spent: those are ``pending`` and the next call, over the
same results folder, skips what is done and runs them (``--force`` reruns everything;
failed and timed-out stages are tried once more, then left). After every stage the whole
picture is rewritten: ``gpu_latest.json`` and ``gpu_latest.txt`` in the results folder and,
with ``--out``, in that folder too with ``gpu-check.tar.gz`` of the results folder (unpack it
into ``.gpu-check/`` to resume on a fresh machine).

``--dry-run`` (no GPU needed; ``tests/test_gpu_check.py``) runs every stage's logic here:
``env`` records what it finds, ``install`` plans without running, ``env-cuda`` and the VMM
stages call a fake CUDA driver, the transfer stages move DRAM instead of VRAM through the
same code, the tests run (and skip), and ``kvxfer-bench`` parses the committed CPU result.

This module is standard library only: it runs in the bare machine's Python, before the
install stage has made the environment the other stages run in.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

DONE = ("ok", "dry", "unavailable")  # a later call skips these
MAX_ATTEMPTS = 2  # failed / timed-out stages: tried once more by a later call, then left
LOG_KEEP = 1 << 20  # bytes of each stage's log kept in the tarball


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
    Stage("lanes", 400, 60, "UCX lane of a READ and a WRITE per memory kind (UCX_PROTO_INFO=y)"),
    Stage("bench-ipc", 420, 120, "engine cudaMalloc + legacy IPC: kvxfer/raw NIXL/copy/staged, 2 MiB-1 GiB"),
    Stage("bench-vmm_fd", 420, 120, "VMM pools, POSIX fd: kvxfer/raw NIXL/copy/staged, 2 MiB-1 GiB"),
    Stage("bench-vmm_fabric", 420, 120, "VMM pools, fabric handle: the same, where the machine allows"),
    Stage("knobs", 420, 150, "GET_ZCOPY, MEMTYPE_CACHE, NIXL threads, chunk size, one at a time"),
    Stage("kvxfer-bench", 420, 150, "kvxfer bench --device cuda:0 (the CLI's own comparison)"),
    Stage("pd-throughput", 240, 40, "benchmarks/pd_throughput.py --device cuda:0"),
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
        p = subprocess.Popen(argv, stdout=fo, stderr=fe, cwd=ctx.repo, env=stage_env(ctx),
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


# --------------------------------------------------------------------------- state, reports


def load_state(ctx: Ctx, name: str) -> dict[str, Any]:
    try:
        with open(ctx.path("stages", f"{name}.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def save_state(ctx: Ctx, state: dict[str, Any]) -> None:
    os.makedirs(ctx.path("stages"), exist_ok=True)
    _write(ctx.path("stages", f"{state['name']}.json"), json.dumps(state, indent=1, default=str))


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def still_valid(ctx: Ctx, stage: Stage, state: dict[str, Any]) -> bool:
    """A stage done in an earlier call that must run again here: the install, on a machine
    that does not have the kit's environment (a fresh one)."""
    if stage.name == "install" and state.get("status") == "ok":
        from kvxfer.testing.gpu_install import installed

        return installed(ctx.repo)
    return True




def gpu_seen(ctx: Ctx) -> tuple[bool, str]:
    """Whether the GPU stages can run here (always, in a dry run)."""
    if ctx.dry:
        return True, ""
    cuda = load_state(ctx, "env-cuda").get("result", {}).get("torch", {})
    if cuda.get("cuda_available") is False:
        return False, f"torch sees no CUDA device ({cuda.get('version', '?')}, CUDA {cuda.get('cuda', '?')})"
    env = load_state(ctx, "env").get("result", {})
    if env and not env.get("gpus") and not cuda:
        return False, "nvidia-smi lists no GPU"
    return True, ""


def _commit(repo: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        p = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5, check=False)
        if p.returncode == 0:
            return p.stdout.strip()
    return "-"


def report(ctx: Ctx, call: dict[str, Any], budget: float) -> dict[str, Any]:
    stages = {s.name: load_state(ctx, s.name) or {"name": s.name, "what": s.what, "status": "pending",
                                                    "reason": "not run yet"} for s in STAGES}
    left = [n for n, s in stages.items() if s.get("status") not in DONE and
            not (s.get("status") in ("failed", "timeout") and s.get("attempts", 0) >= MAX_ATTEMPTS)]
    env = stages["env"].get("result", {})
    doc = {"kit": "kvxfer gpu-check", "format": 1, "dry_run": ctx.dry,
           "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(ctx.repo),
           "machine": {"host": env.get("host"), "gpus": env.get("gpus"), "driver": env.get("driver")},
           "budget_s": budget, "call": call, "complete": not left, "left": left,
           "next": "nothing: every stage has a result" if not left else
           f"run again over the same results ({len(left)} stages left: {', '.join(left)})",
           "stages": stages}
    _write(ctx.path("gpu_latest.json"), json.dumps(doc, indent=1, default=str))
    _write(ctx.path("gpu_latest.txt"), summary(doc))
    return doc


def summary(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    gpu = ", ".join(g.get("name", "?") for g in m.get("gpus") or []) or "no GPU seen"
    head = ("DRY RUN: no GPU here; DRAM and a fake CUDA driver stand in, nothing below is a GPU result"
            if doc["dry_run"] else f"GPU: {gpu}, driver {m.get('driver')}")
    c = doc["call"]
    lines = [f"kvxfer gpu-check ({doc['generated']}, commit {doc['commit']}) on {m.get('host')}", head,
             f"call {c['number']}: {c['seconds']} s of a {doc['budget_s']:.0f} s budget; "
             f"ran {c['ran'] or 'nothing'}; complete: "
             + ("yes" if doc["complete"] else f"no, {doc['next']}"),
             "",
             f"{'stage':<17} {'status':<12} {'secs':>6}  what"]
    for name, s in doc["stages"].items():
        lines.append(f"{name:<17} {s.get('status', '?'):<12} {s.get('seconds', 0):>6}  {s.get('what', '')}"
                     + (" [earlier call]" if name not in c["ran"] and s.get("started") else ""))
    for name, s in doc["stages"].items():
        res = s.get("result") or {}
        body = list(res.get("summary_lines") or [])
        if s.get("reason"):
            body.insert(0, f"  {s['status']}: {s['reason']}")
        if s.get("status") in ("failed", "timeout") and s.get("stderr_tail"):
            tail = s["stderr_tail"].strip().splitlines()[-8:]
            body += ["  stderr (last lines):", *(f"    {ln}" for ln in tail)]
        if body:
            lines += ["", f"== {name} ==", *body]
    return "\n".join(lines) + "\n"


def export(ctx: Ctx, out: str) -> None:
    """``gpu_latest.json``, ``gpu_latest.txt`` and ``gpu-check.tar.gz`` (the results folder,
    logs cut to their last MiB) into ``out``: three files, within what a device call returns."""
    os.makedirs(out, exist_ok=True)
    for f in ("gpu_latest.json", "gpu_latest.txt"):
        shutil.copyfile(ctx.path(f), os.path.join(out, f))
    tmp = os.path.join(out, "gpu-check.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for base, _dirs, files in os.walk(ctx.results):
            for f in sorted(files):
                if f.endswith(".tmp"):
                    continue
                full = os.path.join(base, f)
                arc = os.path.relpath(full, ctx.results)
                with open(full, "rb") as fh:
                    fh.seek(0, 2)
                    size = fh.tell()
                    fh.seek(max(0, size - LOG_KEEP))
                    data = fh.read()
                info = tarfile.TarInfo(arc)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, os.path.join(out, "gpu-check.tar.gz"))


def resume_from(ctx: Ctx, src: str) -> list[str]:
    """Stage results of an earlier call (a results folder or its tarball) that this results
    folder lacks."""
    got = []
    os.makedirs(ctx.path("stages"), exist_ok=True)
    if os.path.isdir(src):
        names = {f: os.path.join(src, "stages", f) for f in os.listdir(os.path.join(src, "stages"))}
        items = [(f, open(p, "rb").read()) for f, p in names.items() if f.endswith(".json")]  # noqa: SIM115
    else:
        with tarfile.open(src) as tar:
            items = [(os.path.basename(m.name), tar.extractfile(m).read())  # type: ignore[union-attr]
                     for m in tar.getmembers() if m.isfile() and m.name.startswith("stages/")
                     and m.name.endswith(".json")]
    for f, data in items:
        dest = ctx.path("stages", f)
        if not os.path.exists(dest):
            with open(dest, "wb") as fh:
                fh.write(data)
            got.append(f)
    return got


# --------------------------------------------------------------------------- the call


def run(args: argparse.Namespace) -> int:
    t_call = time.monotonic()
    repo = os.path.abspath(args.repo)
    results = os.path.abspath(args.results or os.path.join(repo, ".gpu-check-dry" if args.dry_run
                                                           else ".gpu-check"))
    os.makedirs(os.path.join(results, "stages"), exist_ok=True)
    os.makedirs(os.path.join(results, "logs"), exist_ok=True)
    ctx = Ctx(repo, results, args.dry_run, args.device, args.python or sys.executable, args.force,
              frozenset(args.inject_hang or ()), frozenset(args.inject_fail or ()), args.cuda_major)
    if args.resume_from:
        print(f"resumed from {args.resume_from}: {resume_from(ctx, args.resume_from)}", flush=True)
    only = [s.strip() for s in args.only.split(",")] if args.only else [s.name for s in STAGES]
    unknown = [n for n in only if n not in BY_NAME]
    if unknown:
        print(f"unknown stages: {unknown}; stages are {[s.name for s in STAGES]}", file=sys.stderr)
        return 2
    overrides = dict(kv.split("=", 1) for kv in args.stage_timeout or ())
    calls_path = ctx.path("calls.json")
    calls = json.load(open(calls_path)) if os.path.exists(calls_path) else []  # noqa: SIM115
    call: dict[str, Any] = {"number": len(calls) + 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "ran": [], "skipped": [], "deferred": [], "seconds": 0}
    budget = args.budget_s
    failed = False
    deferring = False
    for stage in STAGES:
        if stage.name not in only:
            continue
        prev = load_state(ctx, stage.name)
        if not ctx.force and prev.get("status") in DONE and still_valid(ctx, stage, prev):
            call["skipped"].append(stage.name)
            continue
        spent = prev.get("status") in ("failed", "timeout") and prev.get("attempts", 0) >= MAX_ATTEMPTS
        if spent and not ctx.force:
            call["skipped"].append(stage.name)  # (left: --force tries it again)
            continue
        left = budget - (time.monotonic() - t_call)
        if deferring or left < stage.expect_s:
            deferring = True  # (a later stage may need this one: keep the order)
            call["deferred"].append(stage.name)
            save_state(ctx, {**prev, "name": stage.name, "what": stage.what, "status": "pending",
                             "reason": f"left for the next call ({left:.0f} s of the budget were left)"})
            continue
        ok, why = (True, "") if not stage.gpu else gpu_seen(ctx)
        print(f"[gpu-check] {stage.name}: {stage.what} (deadline {min(left, stage.timeout_s):.0f} s)",
              flush=True)
        if not ok:
            state = {"name": stage.name, "what": stage.what, "status": "unavailable", "reason": why,
                     "seconds": 0, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "attempts": prev.get("attempts", 0) + 1}
        else:
            own = float(overrides.get(stage.name, stage.timeout_s))
            state = run_stage(ctx, stage, min(own, left), cut_by_budget=left < own, prev=prev)
        save_state(ctx, state)
        call["ran"].append(stage.name)
        failed |= state["status"] in ("failed", "timeout")
        print(f"[gpu-check] {stage.name}: {state['status']} in {state.get('seconds', 0)} s"
              + (f" ({state.get('reason')})" if state.get("reason") else ""), flush=True)
        call["seconds"] = round(time.monotonic() - t_call, 1)
        report(ctx, call, budget)
        if args.out:
            export(ctx, args.out)
    call["seconds"] = round(time.monotonic() - t_call, 1)
    _write(calls_path, json.dumps([*calls, call], indent=1))
    doc = report(ctx, call, budget)
    if args.out:
        export(ctx, args.out)
    print(summary(doc), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------- a stage's own process


def worker(args: argparse.Namespace) -> int:
    """``--worker NAME``: one stage's work, its result written (and rewritten as it goes)
    to ``--result``."""
    name, dry, device = args.worker, args.dry_run, args.device

    def emit(res: dict[str, Any]) -> None:
        _write(args.result, json.dumps(res, indent=1, default=str))

    if name == "env":
        from kvxfer.testing.gpu_probe import env_basic

        res = env_basic()
    elif name == "install":
        from kvxfer.testing.gpu_install import install

        res = install(os.path.abspath(args.repo), _cuda_major(args), dry, force=args.force)
    elif name == "env-cuda":
        from kvxfer.testing.gpu_probe import env_cuda

        res = env_cuda(dry)
    elif name == "lanes":
        from kvxfer.testing.gpu_bench import stage_lanes

        res = stage_lanes(dry, device, emit)
    elif name.startswith("bench-"):
        from kvxfer.testing.gpu_bench import stage_bench

        res = stage_bench(name.split("-", 1)[1], dry, device, emit)
    elif name == "knobs":
        from kvxfer.testing.gpu_bench import stage_knobs

        res = stage_knobs(dry, device, emit)
    else:
        print(f"no worker for stage {name!r}", file=sys.stderr)
        return 2
    emit(res)
    return 0


def _cuda_major(args: argparse.Namespace) -> int | None:
    """``--cuda-major``, else torch's CUDA (its libraries are the ones NIXL loads), else the
    driver's (the env stage's)."""
    if args.cuda_major:
        return int(args.cuda_major)
    if args.dry_run:
        return 13  # (no GPU to detect; the plan is the same code)
    try:
        import torch

        if torch.version.cuda:
            return int(torch.version.cuda.split(".")[0])
    except ImportError:
        pass
    try:
        with open(os.path.join(args.results, "stages", "env.json")) as fh:
            return json.load(fh)["result"].get("cuda_driver_major")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.gpu_check",
                                 description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="also copy the results here (default: $OUT when set)")
    ap.add_argument("--results", help="the results folder kept between calls (default .gpu-check, "
                                      "or .gpu-check-dry with --dry-run)")
    ap.add_argument("--repo", default=os.getcwd(), help="the kvxfer checkout (default: here)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="this call's time for stages")
    ap.add_argument("--only", help="comma-separated stages (default: all, in order)")
    ap.add_argument("--force", action="store_true", help="run stages that are done again (and reinstall)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: DRAM and a fake driver stand in")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--python", help="the stages' interpreter (default: this one)")
    ap.add_argument("--cuda-major", type=int, help="install NIXL for this CUDA major (default: torch's)")
    ap.add_argument("--resume-from", help="an earlier call's results folder or gpu-check.tar.gz")
    ap.add_argument("--stage-timeout", action="append", metavar="STAGE=SECONDS",
                    help="a stage's own deadline instead of its default")
    ap.add_argument("--inject-hang", action="append", help=argparse.SUPPRESS)  # tests: a stage that hangs
    ap.add_argument("--inject-fail", action="append", help=argparse.SUPPRESS)  # tests: a stage that fails
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
