"""What ``make gpu-check`` records about the machine (``kvxfer.testing.gpu_check``).

Two stages. ``env`` runs first, in the bare machine's own Python and with the standard
library only (it must work before anything is installed): driver, GPU, CUDA, NVLink/P2P
topology from ``nvidia-smi``, Yama ``ptrace_scope``, the PID namespace, IMEX channels, and
whether one process can take another's fd with ``pidfd_getfd`` (what UCX >= 1.22 needs to
hand a VMM POSIX-fd allocation to a peer; two sidecars are siblings, not parent and child).
``env-cuda`` runs in the kit's environment: torch, ``cuda.bindings`` and NIXL versions, the
UCX that NIXL loaded, and what the driver says of each kind of pool kvxfer can be given
(``CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES``, ``..._IS_LEGACY_CUDA_IPC_CAPABLE``):
engine ``cudaMalloc`` memory, that memory imported by another process over legacy IPC, a
VMM allocation with a POSIX fd, and one with a fabric handle.

In a dry run (no GPU) ``env`` records what it finds (no ``nvidia-smi``: said so) and
``env-cuda`` runs its driver calls against ``dry_driver()``, the fake of ``tests/fake_cuda.py``.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

from kvxfer.testing.gpu_owner import owner_exit
from kvxfer.testing.gpu_owner import summary as owner_summary

PACKAGES = ("torch", "numpy", "nixl-cu13", "nixl-cu12", "nixl", "cuda-bindings", "cuda-python", "pyzmq",
            "msgspec", "uvloop", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
            "prometheus-client", "pytest", "pytest-timeout", "hypothesis", "pip", "setuptools", "wheel",
            "packaging", "kvxfer")


def versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = "-"
    return out


def run(cmd: list[str], timeout: float = 20) -> dict[str, Any]:
    """A command's exit code and output (tails), or that it is not there."""
    if shutil.which(cmd[0]) is None:
        return {"cmd": " ".join(cmd), "missing": True}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"cmd": " ".join(cmd), "timeout": timeout}
    return {"cmd": " ".join(cmd), "rc": p.returncode, "out": p.stdout[-6000:], "err": p.stderr[-1500:]}


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def cuda_major(smi_header: str = "", torch_cuda: str | None = None) -> int | None:
    """The CUDA major version to install for: torch's build when known (its CUDA libraries
    are the ones NIXL's will load), else the driver's (``nvidia-smi``'s "CUDA Version")."""
    if torch_cuda:
        return int(torch_cuda.split(".")[0])
    m = re.search(r"CUDA Version:\s*(\d+)", smi_header)
    return int(m.group(1)) if m else None


def sibling_fd_test(timeout: float = 15) -> dict[str, Any]:
    """Can a process take an fd of its *sibling* with ``pidfd_getfd`` (Yama ptrace_scope=1
    refuses it; so does another PID namespace)? Two children of this process: one holds a
    memfd, the other tries to take it."""
    if not hasattr(os, "pidfd_open"):
        return {"ok": False, "reason": "no os.pidfd_open (Python < 3.9 or not Linux)"}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os,sys; fd=os.memfd_create('gc'); print(os.getpid(), fd, flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        pid, fd = holder.stdout.readline().split()
        code = ("import ctypes,os,json; libc=ctypes.CDLL(None, use_errno=True); "
                f"p=os.pidfd_open({pid}); r=libc.syscall(438, p, {fd}, 0); e=ctypes.get_errno(); "
                "print(json.dumps({'ok': r >= 0, 'errno': 0 if r >= 0 else e, "
                "'error': '' if r >= 0 else os.strerror(e)}))")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           check=False)
        if p.returncode != 0:
            return {"ok": False, "reason": p.stderr.strip()[-500:]}
        return json.loads(p.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"}
    finally:
        with contextlib.suppress(Exception):
            assert holder.stdin is not None
            holder.stdin.close()
        holder.wait(5)


def _meminfo() -> str:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal"):
            return line.split(":", 1)[1].strip()
    return "?"


def env_basic() -> dict[str, Any]:
    """The ``env`` stage (standard library only)."""
    import resource

    smi = run(["nvidia-smi"])
    header = "\n".join((smi.get("out") or "").splitlines()[:4])
    fields = "index,name,uuid,driver_version,memory.total,pci.bus_id,compute_cap"
    query = run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    gpus = [dict(zip(("index", "name", "uuid", "driver", "memory", "pci", "compute_cap"),
                     (c.strip() for c in line.split(",")), strict=False))
            for line in (query.get("out") or "").splitlines() if line.strip()] if query.get("rc") == 0 else []
    q = run(["nvidia-smi", "-q"])
    fabric = [ln.strip() for ln in (q.get("out") or "").splitlines()
              if re.search(r"fabric|imex|clique", ln, re.I)]
    ns = _pid_namespace()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out: dict[str, Any] = {
        "host": platform.node(), "kernel": platform.release(), "os": _os_release(),
        "arch": platform.machine(), "cpus": os.cpu_count(), "memory": _meminfo(),
        "python": sys.version.split()[0], "executable": sys.executable,
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "cuda_driver_major": cuda_major(header),
        "nvidia_smi": {"header": header, "missing": bool(smi.get("missing")), "rc": smi.get("rc")},
        "topology": run(["nvidia-smi", "topo", "-m"]),
        "nvlink": run(["nvidia-smi", "nvlink", "-s"]),
        "fabric_lines": fabric[:20],
        "ptrace_scope": _read("/proc/sys/kernel/yama/ptrace_scope"),
        "pid_namespace": {**ns, "pid": os.getpid(), "init": _read("/proc/1/comm")},
        "imex": {"channels": sorted(os.listdir("/dev/nvidia-caps-imex-channels"))
                 if os.path.isdir("/dev/nvidia-caps-imex-channels") else None,
                 "nvidia_imex": shutil.which("nvidia-imex"),
                 "config": os.path.exists("/etc/nvidia-imex/nodes_config.cfg")},
        "dev_nvidia": sorted(glob.glob("/dev/nvidia*"))[:40],
        "memlock": {"soft": soft, "hard": hard},
        "container": {"dockerenv": os.path.exists("/.dockerenv"),
                      "cgroup": (_read("/proc/self/cgroup") or "")[:300]},
        "pidfd_getfd_sibling": sibling_fd_test(),
        "uid": os.getuid(),
        "packages": versions(),
        "ensurepip": _has("ensurepip"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    pg = out["pidfd_getfd_sibling"]
    getfd = "yes" if pg.get("ok") else f"NO ({pg.get('error') or pg.get('reason')})"
    out["summary_lines"] = [
        f"  GPU: {', '.join(g.get('name', '?') for g in gpus) or 'none (no nvidia-smi or no GPU)'}; "
        f"driver {out['driver']}; CUDA (driver) {out['cuda_driver_major']}",
        f"  kernel {out['kernel']}; python {out['python']} at {sys.executable}; "
        f"torch {out['packages']['torch']}",
        f"  ptrace_scope {out['ptrace_scope']}; PID ns {ns.get('pid_ns')} (NSpid {ns.get('NSpid')}); "
        f"pidfd_getfd between siblings: {getfd}",
        f"  IMEX channels {out['imex']['channels']}; nvidia-imex {out['imex']['nvidia_imex']}; "
        f"fabric lines {len(fabric)}",
    ]
    return out


def _pid_namespace() -> dict[str, Any]:
    """This process's ids in its PID namespaces (``NSpid``, ``NStgid``) and that namespace."""
    ns: dict[str, Any] = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(("NSpid", "NStgid")):
            k, v = line.split(":", 1)
            ns[k] = v.split()
    with contextlib.suppress(OSError):
        ns["pid_ns"] = os.readlink("/proc/self/ns/pid")
    return ns


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _os_release() -> str:
    for line in (_read("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return "?"


# --------------------------------------------------------------------------- the driver's view (env-cuda)


def dry_driver(fabric_permitted: bool = False) -> Any:
    """``tests/fake_cuda.FakeDriver`` with the pointer-attribute calls this probe makes (a
    dry run runs from the repository root, where ``tests`` is importable)."""
    import enum

    from tests.fake_cuda import CUresult, FakeDriver

    class CUpointer_attribute(enum.IntEnum):  # noqa: N801 (the driver's names)
        CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
        CU_POINTER_ATTRIBUTE_MAPPED = 13
        CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14

    class DryDriver(FakeDriver):
        def cuDriverGetVersion(self) -> tuple[Any, int]:  # noqa: N802
            self._log("cuDriverGetVersion")
            return CUresult.CUDA_SUCCESS, 13000

        def cuPointerGetAttribute(self, attribute: Any, ptr: int) -> tuple[Any, ...]:  # noqa: N802
            self._log("cuPointerGetAttribute", attribute, ptr)
            if int(ptr) not in self.mapped:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            a = CUpointer_attribute(int(attribute))
            if a == CUpointer_attribute.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
                return CUresult.CUDA_SUCCESS, int(self.created[-1].requestedHandleTypes)
            return CUresult.CUDA_SUCCESS, int(a == CUpointer_attribute.CU_POINTER_ATTRIBUTE_MAPPED)

    d = DryDriver(fabric_permitted=fabric_permitted)
    d.CUpointer_attribute = CUpointer_attribute  # type: ignore[attr-defined]
    return d


def handle_type_names(driver: Any, mask: int) -> list[str]:
    t = driver.CUmemAllocationHandleType
    names = [n for n in dir(t) if n.startswith("CU_MEM_HANDLE_TYPE_") and n not in ("CU_MEM_HANDLE_TYPE_NONE",
                                                                                   "CU_MEM_HANDLE_TYPE_MAX")]
    return [n.removeprefix("CU_MEM_HANDLE_TYPE_") for n in names if int(getattr(t, n)) & mask] or ["NONE"]


def pointer_attrs(driver: Any, ptr: int) -> dict[str, Any]:
    """What the driver says of the allocation behind ``ptr`` (needs a context current)."""
    a = driver.CUpointer_attribute
    out: dict[str, Any] = {}
    for key, name in (("allowed_handle_types", "CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES"),
                      ("legacy_ipc_capable", "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE"),
                      ("mapped", "CU_POINTER_ATTRIBUTE_MAPPED")):
        try:
            err, *vals = driver.cuPointerGetAttribute(getattr(a, name), ptr)
        except Exception as e:  # (an attribute the installed bindings do not know)
            out[key] = f"{type(e).__name__}: {e}"
            continue
        if int(err) != 0:
            out[key] = f"error {getattr(err, 'name', err)}"
        elif key == "allowed_handle_types":
            out[key] = handle_type_names(driver, int(vals[0]))
        else:
            out[key] = bool(int(vals[0]))
    return out


def _imported_attrs(tensor: Any, q: Any) -> None:
    """(In a child: ``tensor`` arrived over legacy CUDA IPC.)"""
    try:
        from cuda.bindings import driver

        q.put(pointer_attrs(driver, int(tensor.data_ptr())))
    except Exception as e:
        q.put({"error": f"{type(e).__name__}: {e}"})


def pool_kinds(driver: Any, dry: bool, device: int = 0) -> dict[str, Any]:
    """The driver's attributes of each kind of memory kvxfer can be given."""
    from kvxfer.testing.gpu_xfer import Unavailable, vmm_allocation
    from kvxfer.vmm import Vmm

    out: dict[str, Any] = {}
    if dry:
        out["legacy"] = out["legacy_imported"] = {"status": "dry", "reason": "no torch CUDA here"}
    else:
        import torch
        import torch.multiprocessing as tmp

        t = torch.zeros(2 << 20, dtype=torch.uint8, device=f"cuda:{device}")
        out["legacy"] = {"status": "ok", **pointer_attrs(driver, int(t.data_ptr()))}
        ctx = tmp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_imported_attrs, args=(t, q), daemon=True)
        p.start()
        try:
            out["legacy_imported"] = {"status": "ok", **q.get(timeout=90)}
        except Exception as e:
            out["legacy_imported"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        p.join(10)
    for kind in ("vmm_fd", "vmm_fabric"):
        try:
            v, fd, size, info = vmm_allocation(kind, 2 << 20, device, driver)
        except Unavailable as e:
            out[kind] = {"status": "unavailable", "reason": str(e)}
            continue
        except Exception as e:
            out[kind] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            continue
        try:
            m = Vmm(driver).import_fd(fd, size, device)
            with m.vmm.context(device):
                out[kind] = {"status": "ok", **info, **pointer_attrs(driver, m.va)}
            m.close()
        finally:
            os.close(fd)
    return out


def _ucx() -> dict[str, Any]:
    """The UCX library NIXL loaded in this process: path, version, transport modules."""
    import ctypes

    libs = set()
    for line in (_read("/proc/self/maps") or "").splitlines():
        m = re.search(r"(/\S*libucp[-\w.]*\.so[\w.]*)", line)
        if m:
            libs.add(m.group(1))
    if not libs:
        return {"loaded": False}
    path = sorted(libs)[0]
    out: dict[str, Any] = {"loaded": True, "libucp": path}
    with contextlib.suppress(OSError, AttributeError):
        f = ctypes.CDLL(path).ucp_get_version_string
        f.restype = ctypes.c_char_p
        out["version"] = f().decode()
    found = glob.glob(os.path.join(os.path.dirname(path), "ucx", "libuct_*.so*"))
    mods = sorted({os.path.basename(p).split(".so")[0] for p in found})
    out["uct_modules"] = mods
    return out


def env_cuda(dry: bool) -> dict[str, Any]:
    """The ``env-cuda`` stage (in the kit's environment)."""
    out: dict[str, Any] = {"packages": versions(), "executable": sys.executable}
    if dry:
        out["torch"] = {"cuda_available": False, "reason": "dry run"}
        driver = dry_driver(fabric_permitted=False)
    else:
        import torch

        tc: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                              "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            tc.update(devices=n, name=props.name, capability=f"{props.major}.{props.minor}",
                      uuid=str(props.uuid), memory_gib=round(props.total_memory / 2**30, 1),
                      p2p={f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                           for i in range(n) for j in range(n) if i != j})
        out["torch"] = tc
        try:
            from cuda.bindings import driver
        except ImportError as e:
            driver = None
            out["cuda_bindings_error"] = f"{type(e).__name__}: {e}"
    if driver is not None:
        err, ver = driver.cuDriverGetVersion()
        out["cuda_driver_version"] = int(ver) if int(err) == 0 else f"error {err}"
    else:
        out["cuda_driver_version"] = "no cuda.bindings"
    if driver is None:
        out["pools"] = {"status": "unavailable", "reason": out["cuda_bindings_error"]}
    elif dry or out["torch"].get("cuda_available"):
        out["pools"] = pool_kinds(driver, dry)
    else:
        out["pools"] = {"status": "unavailable", "reason": "torch sees no CUDA device"}
    out["owner_exit"] = _owner_exit(dry, driver is not None and out["torch"].get("cuda_available", False))
    try:
        from kvxfer.testing.gpu_xfer import make_agent, nixl_module

        mod = nixl_module()
        agent = make_agent("gc-probe", "peer", 0)
        out["nixl"] = {"module": mod.__name__, "plugins": sorted(agent.get_plugin_list()),
                       "ucx": _ucx()}
    except Exception as e:
        out["nixl"] = {"error": f"{type(e).__name__}: {e}"}
    pools = out["pools"]
    ucx = out["nixl"].get("ucx", {})
    out["summary_lines"] = [
        f"  torch {out['torch'].get('version', '-')} (CUDA {out['torch'].get('cuda', '-')}), "
        f"GPU {out['torch'].get('name', 'none')}; driver CUDA {out['cuda_driver_version']}; "
        f"cuda-bindings {out['packages']['cuda-bindings']}",
        f"  NIXL {out['nixl'].get('module', out['nixl'].get('error', '?'))}, UCX {ucx.get('version', '?')} "
        f"(modules: {', '.join(m.removeprefix('libuct_') for m in ucx.get('uct_modules', []))})",
        *(f"  pool {k:<16} {v.get('status')}: handle types {v.get('allowed_handle_types', '-')}, "
          f"legacy IPC {v.get('legacy_ipc_capable', '-')}" + (f" ({v['reason']})" if v.get("reason") else "")
          for k, v in (pools.items() if "status" not in pools else [("all", pools)])),
        owner_summary(out["owner_exit"]),
    ]
    return out


def _owner_exit(dry: bool, cuda: bool) -> dict[str, Any]:
    """``kvxfer.testing.gpu_owner``: whether legacy IPC memory outlives its allocating process."""
    if dry or not cuda:
        return {"status": "dry" if dry else "unavailable", "reason": "no CUDA device here"}
    try:
        return owner_exit()
    except Exception as e:
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
