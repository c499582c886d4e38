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
bench-ipc       kvxfer vs raw NIXL vs same-GPU copy vs staged, 2 MiB .. 1 GiB, both layouts
                (``gpu_xfer``); later ``bench-vmm_fd`` and ``bench-vmm_fabric`` the same
kvxfer-bench    ``kvxfer bench --device cuda:0 --json``
lanes           the UCX lane of a READ and a WRITE per memory kind (``UCX_PROTO_INFO=y``)
pd-throughput   ``benchmarks/pd_throughput.py --device cuda:0 --json``
knobs           one knob at a time: GET_ZCOPY, MEMTYPE_CACHE, NIXL threads, chunk size
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

The stages (what each is, its command, running it, reading its result) are
``gpu_stages``; the results folder (stage states, the report, export, resume) is
``gpu_results``; this module is the call: the command line, the budget, the order.

This module is standard library only (so are ``gpu_stages`` and ``gpu_results``): it runs
in the bare machine's Python, before the install stage has made the environment the other
stages run in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from kvxfer.testing.gpu_results import (
    _write,
    export,
    gpu_seen,
    load_state,
    report,
    resume_from,
    save_state,
    still_valid,
    summary,
)
from kvxfer.testing.gpu_stages import BY_NAME, DONE, MAX_ATTEMPTS, STAGES, Ctx, Stage, run_stage

# --------------------------------------------------------------------------- the call


def _context(args: argparse.Namespace) -> Ctx:
    """This call's settings, its results folder made."""
    repo = os.path.abspath(args.repo)
    results = os.path.abspath(args.results or os.path.join(repo, ".gpu-check-dry" if args.dry_run
                                                           else ".gpu-check"))
    os.makedirs(os.path.join(results, "stages"), exist_ok=True)
    os.makedirs(os.path.join(results, "logs"), exist_ok=True)
    return Ctx(repo, results, args.dry_run, args.device, args.python or sys.executable, args.force,
               frozenset(args.inject_hang or ()), frozenset(args.inject_fail or ()), args.cuda_major)


def _attempt(ctx: Ctx, stage: Stage, prev: dict[str, Any], left: float,
             overrides: dict[str, str]) -> dict[str, Any]:
    """``stage`` run now, within ``left`` seconds of the budget (or found unable to run here):
    its new state."""
    ok, why = (True, "") if not stage.gpu else gpu_seen(ctx)
    print(f"[gpu-check] {stage.name}: {stage.what} (deadline {min(left, stage.timeout_s):.0f} s)",
          flush=True)
    if not ok:
        return {"name": stage.name, "what": stage.what, "status": "unavailable", "reason": why,
                "seconds": 0, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "attempts": prev.get("attempts", 0) + 1}
    own = float(overrides.get(stage.name, stage.timeout_s))
    return run_stage(ctx, stage, min(own, left), cut_by_budget=left < own, prev=prev)


def run(args: argparse.Namespace) -> int:
    t_call = time.monotonic()
    ctx = _context(args)
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
        state = _attempt(ctx, stage, prev, left, overrides)
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
