"""The kit's own environment for ``make gpu-check``, on a GPU machine with no package index.

Two halves, standard library only:

* ``wheels`` (``make gpu-wheels``, on a machine that reaches PyPI): downloads the cp312
  manylinux wheels the GPU machine lacks into ``.gpu-wheels/`` (NIXL of the machine's CUDA
  major, pyzmq, msgspec, the gRPC extras, and fallbacks for what the image may hold at another
  version) and slims NIXL's: its wheel carries ``nixl_ep_cuNN`` (expert-parallel kernels,
  ~28 MB compressed, never imported by ``nixl_cuNN``), dropped with its RECORD lines so that
  the folder fits the 64 MiB that travels with a device call.
* ``install`` (the kit's ``install`` stage, on the GPU machine): of kvxfer's requirements
  (and its ``cu<major>`` extra), those the image's Python does not satisfy are taken from
  ``.gpu-wheels`` (following those wheels' own requirements the same way) and installed with
  ``pip install --no-index --no-deps --target .gpu-site``; every later stage runs in the
  image's Python (its torch, built for its CUDA) with the checkout and ``.gpu-site`` first on
  PYTHONPATH. (Not a venv: the image's ``python3`` is itself a venv, and a
  ``--system-site-packages`` venv made from it would not see its torch.) Then every
  requirement is checked and everything the stages use is imported, a NIXL agent with the
  UCX backend created. What is missing is named in the result, never guessed.

A dry run plans the install against the wheels folder and this interpreter's packages and
runs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from typing import Any

SITE = ".gpu-site"  # the kit's packages (pip --target), first on the stages' PYTHONPATH
WHEELS = (".gpu-wheels", "shared/gpu-wheels")
STAMP = ".gpu-check-installed"
NIXL_VERSION = "1.5.1"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 << 20  # what travels with a device call: the working tree and carried paths together


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(repo: str, major: int) -> list[str]:
    """kvxfer's own requirements plus its ``cu<major>`` extra (NIXL, cuda-bindings), from
    pyproject.toml."""
    with open(os.path.join(repo, "pyproject.toml"), "rb") as fh:
        proj = tomllib.load(fh)["project"]
    return [*proj["dependencies"], *proj["optional-dependencies"].get(f"cu{major}", [])]


def _req_name(req: str) -> str:
    return _norm(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0])


def _requirement(req: str) -> Any:
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    return Requirement(req)


def applies(req: str) -> bool:
    """Whether ``req``'s environment marker holds here (True without ``packaging``)."""
    r = _requirement(req)
    return r is None or r.marker is None or bool(r.marker.evaluate())


def fits(req: str, version: str) -> bool:
    r = _requirement(req)
    return r is None or r.specifier.contains(version, prereleases=True)


def satisfied(req: str) -> bool:
    """Whether this interpreter already has ``req`` (any version, without ``packaging``)."""
    try:
        return fits(req, md.version(_req_name(req)))
    except md.PackageNotFoundError:
        return False


def wheels_in(folder: str | None) -> list[dict[str, Any]]:
    if not folder or not os.path.isdir(folder):
        return []
    out = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".whl"):
            parts, path = f[:-4].split("-"), os.path.join(folder, f)
            out.append({"file": f, "path": path, "name": _norm(parts[0]), "version": parts[1],
                        "python": parts[-3], "abi": parts[-2], "bytes": os.path.getsize(path)})
    return out


def wheel_requires(path: str) -> list[str]:
    """A wheel's own requirements (Requires-Dist, extras left out)."""
    try:
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode(errors="replace")
    except (OSError, zipfile.BadZipFile, StopIteration):
        return []
    reqs = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r and "extra==" not in r]


def find_wheels(repo: str) -> str | None:
    for w in WHEELS:
        p = os.path.join(repo, w)
        if os.path.isdir(p):
            return p
    return None


def _py_ok(wheel: dict[str, Any], py: str) -> bool:
    """Whether a wheel installs on CPython ``py`` (e.g. "312"): ``py3``, ``cp312``, or an
    ``abi3`` wheel of an older CPython."""
    for t in wheel["python"].split("."):
        if t in ("py3", f"cp{py}"):
            return True
        if wheel["abi"] == "abi3" and t.startswith("cp3") and t[2:].isdigit() and int(t[2:]) <= int(py):
            return True
    return False


def plan(repo: str, major: int | None, wheels: str | None) -> dict[str, Any]:
    """What the install needs and where each piece comes from: this interpreter, or a wheel
    (whose own requirements are followed the same way)."""
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    present = wheels_in(wheels)
    out: dict[str, Any] = {"python": sys.executable, "python_tag": f"cp{py}", "cuda_major": major,
                           "wheels_dir": wheels, "wheels": [w["file"] for w in present],
                           "wheels_bytes": sum(w["bytes"] for w in present)}
    if major is None:
        out["error"] = ("no CUDA version found (no torch CUDA build, no nvidia-smi): "
                        "cannot pick nixl-cu12/cu13; planned for 13")
        major = 13
    todo = list(requirements(repo, major))
    out["kvxfer_requirements"] = list(todo)
    rows: list[dict[str, Any]] = []
    chosen: list[dict[str, Any]] = []
    seen: set[str] = set()
    while todo:
        r = todo.pop(0)
        name = _req_name(r)
        if name in seen or not applies(r):
            continue
        seen.add(name)
        wheel = next((w for w in present if w["name"] == name and _py_ok(w, py) and fits(r, w["version"])),
                     None)
        src = "installed" if satisfied(r) else "wheel" if wheel else "MISSING"
        rows.append({"requirement": r, "have": _version(name), "source": src,
                     "wheel": wheel and wheel["file"]})
        if src == "wheel":
            assert wheel is not None
            chosen.append(wheel)
            todo += wheel_requires(wheel["path"])
    out["requirements"] = rows
    out["install"] = [w["file"] for w in chosen]
    out["install_paths"] = [w["path"] for w in chosen]
    out["missing"] = [r["requirement"] for r in rows if r["source"] == "MISSING"]
    if out["missing"]:
        out["advice"] = (f"bring wheels for {', '.join(out['missing'])}: `make gpu-wheels GPU_CUDA={major}` "
                         "on a machine that reaches PyPI (add what it lacks to gpu_install.wheel_specs), "
                         "carry .gpu-wheels")
    return out


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


def _run(cmd: list[str], log: list[dict[str, Any]], timeout: float = 240,
         **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    log.append({"cmd": " ".join(cmd)[:2000], "rc": p.returncode, "out": p.stdout[-1500:],
                "err": p.stderr[-3000:]})
    return p


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _stamp(repo: str, wheels: str | None) -> str:
    h = hashlib.sha256()
    with open(os.path.join(repo, "pyproject.toml"), "rb") as fh:
        h.update(fh.read())
    h.update(json.dumps([w["file"] for w in wheels_in(wheels)]).encode())
    h.update(sys.executable.encode())
    return h.hexdigest()[:16]


def site_dir(repo: str) -> str:
    return os.path.join(repo, SITE)


def installed(repo: str) -> bool:
    """Whether this machine has the kit's packages (a fresh machine has not)."""
    return os.path.exists(os.path.join(site_dir(repo), STAMP))


def pythonpath(repo: str) -> list[str]:
    """What the stages put first on ``sys.path``: the checkout, then the kit's packages."""
    return [repo] + ([site_dir(repo)] if os.path.isdir(site_dir(repo)) else [])


CHECK = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
bad = []
for r in json.loads(sys.argv[1]):
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        v = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(f"{r}: not installed")
        continue
    if not req.specifier.contains(v, prereleases=True):
        bad.append(f"{r}: {v} here")
print(json.dumps(bad))
"""

SMOKE = """
import importlib, json, os, sys
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
out = {}
for m in ("kvxfer.sidecar", "zmq", "msgspec", "uvloop", "grpc", "grpc_health.v1", "grpc_reflection.v1alpha",
          "torch", "cuda.bindings.driver", "pytest"):
    try:
        importlib.import_module(m)
        out[m] = "ok"
    except Exception as e:
        out[m] = f"{type(e).__name__}: {e}"[:300]
try:
    from kvxfer.testing.gpu_xfer import make_agent, nixl_module
    out["nixl"] = nixl_module().__name__
    make_agent("gc-smoke", "peer", 0)
    out["nixl_ucx_backend"] = "ok"
except Exception as e:
    out["nixl_ucx_backend"] = f"{type(e).__name__}: {e}"[:500]
print(json.dumps(out))
"""


def _last_json(p: subprocess.CompletedProcess[str]) -> Any:
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (p.stderr or p.stdout)[-2000:]}


def install(repo: str, major: int | None, dry: bool, force: bool = False) -> dict[str, Any]:
    """The ``install`` stage: the wheels the image does not satisfy, ``--no-deps`` into
    ``.gpu-site`` (put on PYTHONPATH for every later stage; the image's ``python3`` may itself
    be a venv, whose packages a new ``--system-site-packages`` venv would not see), then a
    check of every requirement and an import of everything the stages use."""
    wheels = find_wheels(repo)
    out = plan(repo, major, wheels)
    site = site_dir(repo)
    steps: list[dict[str, Any]] = []
    out["steps"] = steps
    nixl = f"nixl-cu{out['cuda_major'] or 13}"
    reqs = out["kvxfer_requirements"] + [r for p in out["install_paths"] for r in wheel_requires(p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, site])}
    commands = [
        [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "-q", "--target", site, *out["install_paths"]],
        [sys.executable, "-c", CHECK, json.dumps(reqs)],
        [sys.executable, "-c", SMOKE],
    ]
    out["commands"] = [" ".join(c[:12]) + (" ..." if len(c) > 12 else "") for c in commands]
    if dry:
        out.update(status="dry", summary_lines=[
            f"  would install {len(out['install'])} wheels into {SITE} (dry run: nothing run): "
            f"{', '.join(out['install']) or '-'}",
            f"  wheels: {wheels or 'none found'} ({len(out['wheels'])} files, "
            f"{out['wheels_bytes'] / 2**20:.1f} MiB); missing: {out['missing'] or 'nothing'}",
            *([f"  {out['error']}"] if out.get("error") else [])])
        return out
    stamp = _stamp(repo, wheels)
    fresh = force or _read(os.path.join(site, STAMP)) != stamp
    if fresh:
        shutil.rmtree(site, ignore_errors=True)
        os.makedirs(site)
        if out["install_paths"] and _run(commands[0], steps).returncode != 0:
            return {**out, "status": "failed", "reason": f"pip install --target {SITE} failed: "
                    f"{steps[-1]['err'][-500:]}"}
    unmet = _last_json(_run(commands[1], steps, env=env))
    smoke = _last_json(_run(commands[2], steps, cwd=repo, env=env))
    out["unmet"], out["smoke"] = unmet, smoke
    broken = {k: v for k, v in smoke.items() if v != "ok" and k != "nixl"}
    show = "import json; from kvxfer.testing.gpu_probe import versions; print(json.dumps(versions()))"
    out["packages"] = _last_json(_run([sys.executable, "-c", show], [], cwd=repo, env=env))
    if broken or unmet:
        why = [*(unmet if isinstance(unmet, list) else [str(unmet)]),
               *(f"{k}: {v}" for k, v in broken.items())]
        out.update(status="failed", reason="; ".join(why)[:1000])
    else:
        with open(os.path.join(site, STAMP), "w") as fh:
            fh.write(stamp)
        out.update(status="ok")
    vp = out["packages"] if isinstance(out["packages"], dict) else {}
    out["summary_lines"] = [
        f"  {'installed' if fresh else 'already there'}: {len(out['install'])} wheels into {SITE}; "
        f"NIXL {smoke.get('nixl', '?')} {vp.get(nixl, '-')}, pyzmq {vp.get('pyzmq', '-')}, "
        f"msgspec {vp.get('msgspec', '-')}, grpcio {vp.get('grpcio', '-')}, "
        f"protobuf {vp.get('protobuf', '-')}, cuda-bindings {vp.get('cuda-bindings', '-')}",
        f"  missing: {out['missing'] or 'nothing'}; unmet: {unmet or 'nothing'}; smoke: "
        + ("all imports ok, UCX backend ok" if not broken else json.dumps(broken)[:300]),
    ]
    return out


# --------------------------------------------------------------------------- wheels (a machine with PyPI)


def slim_wheel(path: str, drop: tuple[str, ...] = ("nixl_ep_cu12/", "nixl_ep_cu13/")) -> tuple[int, int]:
    """Rewrite a wheel without the files under ``drop`` (and their RECORD lines): bytes
    before and after."""
    before = os.path.getsize(path)
    tmp = path + ".slim"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [ln for ln in data.decode().splitlines() if not ln.startswith(drop)]
                data = ("\n".join(kept) + "\n").encode()
            zout.writestr(info, data)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def wheel_specs(major: int) -> list[str]:
    """What a GPU machine of the kind seen so far lacks (nixl, pyzmq, msgspec, the gRPC
    extras), then fallbacks for packages it may hold at another version."""
    cb = "cuda-bindings>=12.8,<13" if major == 12 else f"cuda-bindings>={major},<{major + 1}"
    return [f"nixl-cu{major}=={NIXL_VERSION}", "pyzmq>=26", "msgspec>=0.19",
            "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1",
            # fallbacks: installed only where the image's version does not fit kvxfer's requirement
            "grpcio==1.85.1", "protobuf>=7.35.1,<8", "prometheus-client>=0.20", cb, "cuda-pathfinder"]


def download(dest: str, python_version: str, major: int, slim: bool = True) -> dict[str, Any]:
    os.makedirs(dest, exist_ok=True)
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *plats, "-d", dest, *wheel_specs(major)]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    slimmed = {}
    if slim:
        for w in wheels_in(dest):
            if w["name"].startswith("nixl-cu"):
                slimmed[w["file"]] = slim_wheel(os.path.join(dest, w["file"]))
    files = wheels_in(dest)
    total = sum(w["bytes"] for w in files)
    return {"dest": dest, "files": files, "bytes": total, "slimmed": slimmed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.gpu_install")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="download the GPU machine's wheels (needs PyPI)")
    w.add_argument("--dest", default=WHEELS[0])
    w.add_argument("--python-version", default="3.12")
    w.add_argument("--cuda", type=int, default=13, help="CUDA major of the GPU machine (12 or 13)")
    w.add_argument("--no-slim", action="store_true", help="keep nixl_ep in NIXL's wheel")
    p = sub.add_parser("plan", help="what an install here would take from where")
    p.add_argument("--cuda", type=int, default=13)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        print(json.dumps(plan(os.getcwd(), a.cuda, find_wheels(os.getcwd())), indent=1))
        return 0
    res = download(a.dest, a.python_version, a.cuda, slim=not a.no_slim)
    for f in res["files"]:
        print(f"  {f['bytes'] / 2**20:7.2f} MiB  {f['file']}")
    for f, (b, s) in res["slimmed"].items():
        print(f"  slimmed {f}: {b / 2**20:.1f} -> {s / 2**20:.1f} MiB (nixl_ep dropped)")
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=False).stdout.split()
    tracked = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    total = res["bytes"] + tracked
    print(f"  wheels {res['bytes'] / 2**20:.1f} MiB + tracked files {tracked / 2**20:.1f} MiB = "
          f"{total / 2**20:.1f} MiB of the {CARRY_LIMIT >> 20} MiB a device call carries"
          + ("" if total < CARRY_LIMIT else "  ** TOO LARGE: drop the fallbacks you do not need **"))
    return 0 if total < CARRY_LIMIT else 1


if __name__ == "__main__":
    raise SystemExit(main())
