"""What the transfer stages of ``make gpu-check`` (``kvxfer.testing.gpu_check``) move and
how they check it: the blocks and their byte pattern, each kind of GPU memory kvxfer can be
given, and NIXL agents configured as kvxfer's sidecars configure theirs. Built on it: which
UCX lane carries a READ and a WRITE (``gpu_lanes``), and how fast kvxfer, raw NIXL and a
same-device copy move the same blocks (``gpu_bench``).

Memory kinds (``alloc``):

* ``ipc``: engine-owned ``cudaMalloc`` memory (torch), what an engine exports over legacy
  CUDA IPC; ``ipc_imported``: that memory as the sidecar sees it, opened in another process
  with ``cudaIpcOpenMemHandle`` (torch.multiprocessing does the same as ``kvxfer.memory``);
* ``vmm_fd`` / ``vmm_fabric``: a CUDA VMM allocation exportable as a POSIX fd only, or with
  a fabric handle too (``kvxfer.vmm``, as the sidecar's GPU pools);
* ``dram`` (numpy) and ``torch_cpu`` (a torch tensor in host memory): the stand-ins of a dry
  run on a machine without a GPU; ``torch_cpu`` runs the torch code of the GPU kinds.

Raw NIXL (``gpu_pair.Pair``) runs one agent in each of two processes that own (or import)
their memory, the in-engine connector's arrangement: a target (the prefill engine) and an
initiator (the decode engine), both driven over pipes by this process, with the strided
descriptors kvxfer itself prepares (``strided``: one row per (layer, K/V) region and 32 KiB
blocks, or one 2 MiB row per block when blocks are outermost). kvxfer
(``gpu_bench.kvxfer_sweep``) goes through two real ``kvxfer serve`` processes and synthetic
engines. Every transfer's destination is zeroed first and every byte checked after it
against the pattern the source was filled with (a hash of the byte's offset, so a block
landing in the wrong place is caught).

What never runs here: anything without a deadline. Every call to a worker process has a
timeout (``gpu_pair``) and every transfer a deadline (``XFER_TIMEOUT_S``), so a stuck UCX
lane is an error with a message, not a hang.

Written on a machine without a GPU: only the ``dram`` and ``torch_cpu`` kinds and the
fake-driver checks have run (``tests/test_gpu_check.py``); the GPU kinds wait for their
first GPU.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK = 2 << 20  # 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16
REGIONS = 64  # (layer, K/V) regions of a block
PIECE = BLOCK // REGIONS  # 32 KiB: one region's share of a block, one descriptor
LAYOUTS = ("LBNHC", "BLNHC")  # vLLM's names: layer-outermost, block-outermost
GPU_KINDS = ("ipc", "vmm_fd", "vmm_fabric")
XFER_TIMEOUT_S = 60.0


class Unavailable(Exception):
    """This machine cannot give this kind of memory (recorded as 'unavailable', not failed)."""


# --------------------------------------------------------------------------- the bytes


def _torch(buf: Any) -> bool:
    return not isinstance(buf, np.ndarray)


def region_view(buf: Any, nb: int, layout: str) -> Any:
    """``[regions, nb, PIECE]`` over the first ``nb`` blocks of a flat uint8 buffer."""
    flat = buf[:nb * BLOCK]
    if layout == "LBNHC":
        return flat.reshape(REGIONS, nb, PIECE)
    v = flat.reshape(nb, REGIONS, PIECE)
    return v.permute(1, 0, 2) if _torch(buf) else v.transpose(1, 0, 2)


def _pattern(off: Any, seed: int) -> Any:
    """The byte at offset ``off`` of a buffer filled with ``seed``: a hash of its 256-byte
    piece mixed with the offset, so no two blocks (or regions) of one buffer are alike."""
    h = (off >> 8) * 0x9E3779B1 + seed * 0x85EBCA6B
    return ((h >> 24) ^ off ^ (seed * 101)) & 255


def fill(buf: Any, seed: int, chunk: int = 32 << 20) -> None:
    n = buf.shape[0]
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        if _torch(buf):
            import torch

            off = torch.arange(start, end, device=buf.device, dtype=torch.int64)
            buf[start:end] = _pattern(off, seed).to(torch.uint8)
        else:
            buf[start:end] = _pattern(np.arange(start, end, dtype=np.int64), seed).astype(np.uint8)
    _sync(buf)


def wipe(buf: Any) -> None:
    buf[:] = 0
    _sync(buf)


def _sync(buf: Any) -> None:
    if _torch(buf) and buf.is_cuda:
        import torch

        torch.cuda.synchronize(buf.device)


def verify(dst: Any, seed: int, src: list[int], dst_blocks: list[int], nb: int, layout: str,
           group: int = 8) -> int:
    """Bytes of blocks ``dst_blocks`` of ``dst`` that differ from blocks ``src`` of a
    buffer of the same geometry filled with ``seed`` (0: every byte is right)."""
    view = region_view(dst, nb, layout)
    # (uint8: element strides are byte strides)
    s_r, s_b = (view.stride(0), view.stride(1)) if _torch(dst) else (view.strides[0], view.strides[1])
    bad = 0
    for i in range(0, len(src), group):
        s, d = src[i:i + group], dst_blocks[i:i + group]
        if _torch(dst):
            import torch

            dev = dst.device
            off = (torch.arange(REGIONS, device=dev)[:, None, None] * s_r
                   + torch.tensor(s, device=dev)[None, :, None] * s_b
                   + torch.arange(PIECE, device=dev)[None, None, :])
            got = view[:, torch.tensor(d, device=dev)]
            bad += int((got != _pattern(off, seed).to(torch.uint8)).sum().item())
        else:
            off = (np.arange(REGIONS)[:, None, None] * s_r + np.asarray(s)[None, :, None] * s_b
                   + np.arange(PIECE)[None, None, :])
            bad += int(np.count_nonzero(view[:, d] != _pattern(off, seed).astype(np.uint8)))
    return bad


def copy_blocks(src: Any, dst: Any, s: list[int], d: list[int], nb: int, layout: str) -> float:
    """A gather/scatter copy of blocks ``s`` of ``src`` into blocks ``d`` of ``dst`` in one
    process (one kernel pair on a GPU): seconds."""
    sv, dv = region_view(src, nb, layout), region_view(dst, nb, layout)
    if _torch(src):
        import torch

        si, di = torch.tensor(s, device=src.device), torch.tensor(d, device=dst.device)
        _sync(src)
        t0 = time.perf_counter()
        dv[:, di] = sv[:, si]
        _sync(dst)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    dv[:, d] = sv[:, s]
    return time.perf_counter() - t0



def block_ids(nb: int, seed: int) -> list[int]:
    """Non-contiguous block ids, as a busy engine hands them out (block 0 is vLLM's null block)."""
    ids = list(range(1, nb))
    random.Random(seed).shuffle(ids)
    return ids


# --------------------------------------------------------------------------- memory


@dataclass
class Mem:
    kind: str
    buf: Any  # flat uint8: numpy (DRAM) or torch (VRAM)
    addr: int
    nbytes: int
    mem_type: str  # NIXL's: "DRAM" | "VRAM"
    dev: int
    info: dict[str, Any] = field(default_factory=dict)
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def close(self) -> None:
        self.buf = None
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c()
        self._closers = []


def _ordinal(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def vmm_allocation(kind: str, nbytes: int, dev: int,
                   driver: Any = None) -> tuple[Any, int, int, dict[str, Any]]:
    """A VMM allocation as the sidecar makes one (``kvxfer.vmm``), with a POSIX fd only
    (``vmm_fd``) or a fabric handle as well (``vmm_fabric``): (the Vmm, its fd, its size,
    what it got). ``driver``: a fake in a dry run."""
    from kvxfer.vmm import Vmm, VmmUnavailable

    try:
        v = Vmm(driver)
        caps = v.caps(dev)
    except VmmUnavailable as e:
        raise Unavailable(f"no VMM pools here: {e.reason}") from e
    info: dict[str, Any] = {"caps": {"vmm": caps.vmm, "posix_fd": caps.posix_fd, "fabric": caps.fabric,
                                     "gpudirect_rdma_vmm": caps.rdma}}
    if kind == "vmm_fabric" and not caps.fabric:
        raise Unavailable("the device offers no fabric handles "
                          "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED=0)")
    if kind == "vmm_fd":
        v._no_fabric.add(dev)  # POSIX fd only, as on a machine without an IMEX channel
    fd, size = v.create_exported(nbytes, dev)
    if kind == "vmm_fabric" and dev in v._no_fabric:
        os.close(fd)
        raise Unavailable("cuMemCreate refused a fabric handle (no IMEX channel?)")
    info.update(handles="posix_fd+fabric" if dev not in v._no_fabric else "posix_fd",
                granularity=v.granularity(dev), size=size)
    return v, fd, size, info


def alloc(kind: str, nbytes: int, device: str = "cuda:0", tensor: Any = None) -> Mem:
    """``nbytes`` of ``kind`` memory (``tensor``: the imported one, for ``ipc_imported``)."""
    if kind == "dram":
        mm = mmap.mmap(-1, nbytes)
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[::mmap.PAGESIZE] = 0  # pre-touch: first-touch faults are not what is measured
        return Mem(kind, arr, int(arr.ctypes.data), nbytes, "DRAM", 0, {}, [])
    import torch

    if kind == "torch_cpu":
        t = torch.zeros(nbytes, dtype=torch.uint8)
        return Mem(kind, t, int(t.data_ptr()), nbytes, "DRAM", 0, {"allocator": "torch, host memory"})

    dev = _ordinal(device)
    if kind == "ipc":
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return Mem(kind, t, int(t.data_ptr()), nbytes, "VRAM", dev, {"allocator": "cudaMalloc (torch)"})
    if kind == "ipc_imported":
        assert tensor is not None, "ipc_imported needs the exporting process's tensor"
        return Mem(kind, tensor, int(tensor.data_ptr()), nbytes, "VRAM", tensor.device.index or 0,
                   {"allocator": "cudaIpcOpenMemHandle (torch.multiprocessing)"})
    if kind in ("vmm_fd", "vmm_fabric"):
        v, fd, size, info = vmm_allocation(kind, nbytes, dev)
        m = v.import_fd(fd, size, dev)
        t = m.tensor()[:nbytes]
        t.zero_()
        torch.cuda.synchronize(dev)
        mem = Mem(kind, t, m.va, nbytes, "VRAM", dev, info)
        mem._closers += [lambda: os.close(fd), m.close, lambda: torch.cuda.synchronize(dev)]
        return mem
    raise ValueError(f"unknown memory kind {kind!r}")


# --------------------------------------------------------------------------- NIXL


def nixl_module() -> Any:
    import importlib

    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL package (nixl-cu13 / nixl-cu12) in this environment")


def make_agent(name: str, mode: str, threads: int) -> Any:
    """An agent configured as kvxfer's sidecars configure theirs (``kvxfer.sidecar.nixl_agent``)."""
    nixl = nixl_module()
    sync = getattr(nixl, "nixl_thread_sync_t", None)
    extra = {"sync_mode": sync.NIXL_THREAD_SYNC_STRICT} if sync is not None else {}
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[],
                                                         num_threads=threads, **extra))
    params = {"ucx_error_handling_mode": mode}
    if threads > 0:
        params["num_threads"] = str(threads)
    agent.create_backend("UCX", params)
    return agent


def strided(base: int, nb: int, layout: str, dev: int) -> np.ndarray:
    """NIXL's strided N x 5 rows ``(addr, len, dev, stride, count)`` of the whole buffer,
    the rows kvxfer prepares (regions inside a block merged when blocks are outermost)."""
    if layout == "BLNHC":
        return np.array([(base, BLOCK, dev, BLOCK, nb)], dtype=np.int64)
    return np.array([(base + r * nb * PIECE, PIECE, dev, PIECE, nb) for r in range(REGIONS)], dtype=np.int64)


def indices(nb: int, layout: str, blocks: list[int]) -> np.ndarray:
    rows = 1 if layout == "BLNHC" else REGIONS
    return (np.arange(rows, dtype=np.int64)[:, None] * nb + np.asarray(blocks, dtype=np.int64)[None, :]
            ).ravel().astype(np.int32)


def _wait_xfer(agent: Any, h: Any, what: str) -> None:
    state = agent.transfer(h)
    deadline = time.monotonic() + XFER_TIMEOUT_S
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} still in progress after {XFER_TIMEOUT_S:.0f} s")
        state = agent.check_xfer_state(h)
    if state != "DONE":
        raise RuntimeError(f"{what} ended in state {state}")


# A size whose one repeat would take longer than this, projected from the size before, is
# skipped with the projection: a lane at 0.07 GB/s (UCX over tcp, seen on the first GPU run)
# would spend a call's whole budget on 1 GiB.
SLOW_S = 6.0


def too_slow(last: tuple[int, float] | None, nbytes: int, row: dict[str, Any]) -> bool:
    """Whether to skip ``nbytes`` after ``last`` (bytes, seconds a repeat) took as long as it
    did; if so ``row`` says why."""
    if last is None or last[1] <= 0:
        return False
    projected = last[1] * nbytes / last[0]
    if projected <= SLOW_S:
        return False
    row["skipped"] = (f"projected {projected:.0f} s a repeat at {last[0] / last[1] / 1e9:.2f} GB/s "
                      f"(over {SLOW_S:.0f} s)")
    return True
