"""One question for the next GPU run (#39), asked by the ``env-cuda`` stage: does device memory
that one process ``cuMemAlloc``ed, and another opened through a legacy CUDA IPC handle, stay
usable in the opener once the allocating process has exited?

Why it matters: UCX moves memory between processes over cuda_ipc (302 GB/s for 2 MiB blocks
on the H200, against kvxfer's staged 66.9) only when the process that registers it allocated
it. A KV cache the sidecar allocates and its engine opens would be read directly at that
speed, but the engine's KV cache would then live in the sidecar's allocation: if it dies with
the sidecar, a sidecar crash takes the engine down, which VMM pools (the engine holds its own
handle) never do. The answer decides whether such a pool kind is worth building.

Standard library and ``cuda.bindings`` only; the allocating process is a spawned child that
exits with ``os._exit`` (no cleanup, as a crash would).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
from typing import Any

from kvxfer.errors import RequestError

SIZE = 2 << 20
BEFORE, AFTER = 0x5A, 0x33
HANDLE_BYTES = 64  # (CU_IPC_HANDLE_SIZE)


def _driver(spec: str) -> Any:
    """The CUDA driver module, or (tests, on a CPU) ``module:function`` that makes a stand-in."""
    if not spec:
        from cuda.bindings import driver

        return driver
    import importlib

    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def _owner(out: Any, go: Any, device: int, spec: str) -> None:
    """(The spawned child: allocate, fill, export, wait, die.)"""
    try:
        from kvxfer.vmm import Vmm

        d = _driver(spec)

        v = Vmm(d)
        buf = v.alloc_device(SIZE, device)
        with v.context(device):
            v._ok(d.cuMemsetD8(buf.ptr, BEFORE, SIZE), "cuMemsetD8")
            v._ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
            handle = v._ok(d.cuIpcGetMemHandle(buf.ptr), "cuIpcGetMemHandle")
        out.put({"handle": ctypes.string_at(handle.getPtr(), HANDLE_BYTES), "legacy_ipc": buf.legacy_ipc})
    except Exception as e:
        out.put({"error": f"{type(e).__name__}: {e}"})
        return
    go.get(timeout=120)
    os._exit(0)


def _first_bytes(v: Any, ptr: int, n: int = 4096) -> bytes:
    host = (ctypes.c_uint8 * n)()
    v._ok(v.d.cuMemcpyDtoH(ctypes.addressof(host), ptr, n), "cuMemcpyDtoH")
    return bytes(host)


def owner_exit(device: int = 0, spec: str = "") -> dict[str, Any]:
    """Open the child's allocation, check it, let the child exit, then read and write it again
    (``spec``: the driver, ``_driver``)."""
    from kvxfer.vmm import Vmm

    d = _driver(spec)
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_owner, args=(out, go, device, spec), daemon=True)
    child.start()
    res: dict[str, Any] = {}
    try:
        got = out.get(timeout=90)
        if "error" in got:
            return {"status": "failed", "reason": f"the allocating process: {got['error']}"}
        res["legacy_ipc_capable"] = got["legacy_ipc"]
        v = Vmm(d)
        with v.context(device):
            handle = d.CUipcMemHandle()  # (opaque in cuda-bindings 13: its 64 bytes through getPtr)
            ctypes.memmove(handle.getPtr(), got["handle"], HANDLE_BYTES)
            flags = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            ptr = int(v._ok(d.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))
            res["read_before_exit"] = _first_bytes(v, ptr) == bytes([BEFORE]) * 4096
            go.put("exit")
            child.join(30)
            res["owner_exit_code"] = child.exitcode
            try:
                res["read_after_exit"] = _first_bytes(v, ptr) == bytes([BEFORE]) * 4096
                v._ok(d.cuMemsetD8(ptr, AFTER, SIZE), "cuMemsetD8")
                v._ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
                res["write_after_exit"] = _first_bytes(v, ptr) == bytes([AFTER]) * 4096
            except RequestError as e:  # (Vmm._ok: the driver's error, named)
                res["error_after_exit"] = str(e)
            close = d.cuIpcCloseMemHandle(ptr)
            res["close"] = getattr(close[0] if isinstance(close, tuple) else close, "name", str(close))
    except Exception as e:
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}", **res}
    finally:
        if child.is_alive():
            go.put("exit")
            child.join(10)
    survives = bool(res.get("read_after_exit") and res.get("write_after_exit"))
    return {"status": "ok", "survives_owner_exit": survives, **res}


def summary(r: dict[str, Any]) -> str:
    head = "  legacy IPC memory after its allocating process exits:"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')} ({r.get('reason', '')})"
    after = ("still readable and writable" if r["survives_owner_exit"]
             else f"lost ({r.get('error_after_exit') or 'bytes wrong'})")
    return (f"{head} {after}; read before {r.get('read_before_exit')}, owner exit code "
            f"{r.get('owner_exit_code')}, close {r.get('close')}")
