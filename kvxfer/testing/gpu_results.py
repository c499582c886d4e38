"""The results folder of ``make gpu-check`` (``kvxfer.testing.gpu_check``): each stage's
state (``stages/<name>.json``), the whole picture rewritten after every stage
(``gpu_latest.json`` and ``gpu_latest.txt``), its export to ``--out`` with
``gpu-check.tar.gz``, and resuming from an earlier call's results or tarball.

This module is standard library only, as ``gpu_check`` is: it runs in the bare machine's
Python, before the install stage has made the environment the other stages run in.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from typing import Any

from kvxfer.testing.gpu_stages import DONE, MAX_ATTEMPTS, STAGES, Ctx, Stage

LOG_KEEP = 1 << 20  # bytes of each stage's log kept in the tarball


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
