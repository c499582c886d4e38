"""The transfer stages of ``make gpu-check`` (``kvxfer.testing.gpu_check``): which UCX lane
carries a READ and a WRITE, and how fast kvxfer, raw NIXL and a same-device copy move the
same blocks, for each kind of GPU memory kvxfer can be given.

Memory kinds (``alloc``):

* ``ipc``: engine-owned ``cudaMalloc`` memory (torch), what an engine exports over legacy
  CUDA IPC; ``ipc_imported``: that memory as the sidecar sees it, opened in another process
  with ``cudaIpcOpenMemHandle`` (torch.multiprocessing does the same as ``kvxfer.memory``);
* ``vmm_fd`` / ``vmm_fabric``: a CUDA VMM allocation exportable as a POSIX fd only, or with
  a fabric handle too (``kvxfer.vmm``, as the sidecar's GPU pools);
* ``dram`` (numpy) and ``torch_cpu`` (a torch tensor in host memory): the stand-ins of a dry
  run on a machine without a GPU; ``torch_cpu`` runs the torch code of the GPU kinds.

Raw NIXL (``Pair``) runs one agent in each of two processes that own (or import) their
memory, the in-engine connector's arrangement: a target (the prefill engine) and an
initiator (the decode engine), both driven over pipes by this process, with the strided
descriptors kvxfer itself prepares (one row per (layer, K/V) region and 32 KiB blocks, or
one 2 MiB row per block when blocks are outermost). kvxfer (``kvxfer_sweep``) goes through
two real ``kvxfer serve`` processes and synthetic engines. Every transfer's destination is
zeroed first and every byte checked after it against the pattern the source was filled
with (a hash of the byte's offset, so a block landing in the wrong place is caught).

What never runs here: anything without a deadline. Every call to a worker process has a
timeout and every transfer a deadline, so a stuck UCX lane is an error with a message,
not a hang.

Written on a machine without a GPU: only the ``dram`` and ``torch_cpu`` kinds and the
fake-driver checks have run (``tests/test_gpu_check.py``); the GPU kinds wait for their
first GPU.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import multiprocessing as mp
import os
import random
import re
import time
import traceback
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
CALL_TIMEOUT_S = 120.0


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


# --------------------------------------------------------------------------- the worker processes


@dataclass
class Spec:
    role: str  # "target" | "initiator"
    kind: str
    nb: int  # blocks in the buffer (both layouts use the same buffer)
    stage_blocks: int  # staging buffer, blocks (0: none)
    device: str
    mode: str
    threads: int
    env: dict[str, str]


class _Worker:
    """One engine process of a raw-NIXL pair."""

    def __init__(self, spec: Spec, tensor: Any) -> None:
        self.s = spec
        nbytes = spec.nb * BLOCK
        self.mem = alloc(spec.kind, nbytes, spec.device, tensor)
        # staging: the sidecar's own cudaMalloc memory whatever the pool kind (it allocates that itself)
        own = {"dram": "dram", "torch_cpu": "torch_cpu"}.get(spec.kind, "ipc")
        self.stage = alloc(own, spec.stage_blocks * BLOCK, spec.device) if spec.stage_blocks else None
        self.copy_src: Mem | None = None
        self.agent = make_agent(f"gc-{spec.role}", spec.mode, spec.threads)
        regs = [(self.mem.addr, self.mem.nbytes, self.mem.dev, "")]
        self.agent.register_memory(regs, self.mem.mem_type)
        if self.stage is not None:
            self.agent.register_memory([(self.stage.addr, self.stage.nbytes, self.stage.dev, "")],
                                       self.stage.mem_type)
        self.remote: dict[str, Any] = {}
        self.dlists: dict[Any, tuple[Any, Any]] = {}
        self.stream: Any = None
        if _torch(self.mem.buf) and self.mem.buf.is_cuda:
            import torch

            self.stream = torch.cuda.Stream(self.mem.dev)  # the sidecar's own stream (staging)

    def hello(self) -> dict[str, Any]:
        return {"md": bytes(self.agent.get_agent_metadata()), "addr": self.mem.addr, "dev": self.mem.dev,
                "mem_type": self.mem.mem_type, "info": self.mem.info,
                "stage_addr": self.stage.addr if self.stage else 0}

    # both roles
    def fill(self, seed: int) -> None:
        fill(self.mem.buf, seed)

    def wipe(self) -> None:
        wipe(self.mem.buf)

    def verify(self, seed: int, src: list[int], dst: list[int], layout: str) -> int:
        return verify(self.mem.buf, seed, src, dst, self.s.nb, layout)

    # the initiator
    def connect(self, peer: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(peer["md"])
        self.remote = {**peer, "name": name.decode() if isinstance(name, bytes) else name}

    def _lists(self, layout: str) -> tuple[Any, Any]:
        if layout not in self.dlists:
            r, nb, m = self.remote, self.s.nb, self.mem
            self.dlists[layout] = (
                self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided(m.addr, nb, layout, m.dev), m.mem_type),
                self.agent.prep_xfer_dlist(r["name"], strided(r["addr"], nb, layout, r["dev"]),
                                           r["mem_type"]))
        return self.dlists[layout]

    def xfer(self, op: str, layout: str, src: list[int], dst: list[int]) -> float:
        """READ: remote ``src`` -> local ``dst``; WRITE: local ``src`` -> remote ``dst``."""
        local, remote = self._lists(layout)
        lb, rb = (dst, src) if op == "READ" else (src, dst)
        li, ri = indices(self.s.nb, layout, lb), indices(self.s.nb, layout, rb)
        t0 = time.perf_counter()
        h = self.agent.make_prepped_xfer(op, local, li, remote, ri)
        try:
            _wait_xfer(self.agent, h, f"raw NIXL {op} of {len(src)} blocks ({layout})")
            return time.perf_counter() - t0
        finally:
            self.agent.release_xfer_handle(h)

    def copy(self, seed: int, layout: str, src: list[int], dst: list[int]) -> float:
        if self.copy_src is None:
            self.copy_src = alloc(self.s.kind if self.s.kind != "ipc_imported" else "ipc", self.mem.nbytes,
                                  self.s.device)  # (a VMM kind: a second VMM allocation)
            fill(self.copy_src.buf, seed)
        return copy_blocks(self.copy_src.buf, self.mem.buf, src, dst, self.s.nb, layout)

    # staging: gather into a contiguous buffer on the sender, one transfer, scatter on the receiver
    def _stage_view(self, n: int) -> Any:
        assert self.stage is not None
        return self.stage.buf[:n * BLOCK].reshape(REGIONS, n, PIECE)

    def gather(self, layout: str, src: list[int]) -> float:
        view, out = region_view(self.mem.buf, self.s.nb, layout), self._stage_view(len(src))
        t0 = time.perf_counter()
        if _torch(view):
            import torch

            with self._on_stream():
                torch.index_select(view, 1, torch.tensor(src, device=view.device), out=out)
            self._stream_sync()
        else:
            np.take(view, src, axis=1, out=out)
        return time.perf_counter() - t0

    def _on_stream(self) -> Any:
        """The sidecar's own CUDA stream current (nothing on host memory)."""
        if self.stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.stream)

    def _stream_sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def staged_read(self, layout: str, dst: list[int]) -> tuple[float, float]:
        n = len(dst)
        assert self.stage is not None
        key = ("stage", n)
        if key not in self.dlists:
            r = self.remote
            self.dlists[key] = (
                self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.stage.addr, n * BLOCK, self.stage.dev)],
                                           self.stage.mem_type),
                self.agent.prep_xfer_dlist(r["name"], [(r["stage_addr"], n * BLOCK, r["dev"])],
                                           self.stage.mem_type))
        local, remote = self.dlists[key]
        t0 = time.perf_counter()
        h = self.agent.make_prepped_xfer("READ", local, np.zeros(1, np.int32), remote, np.zeros(1, np.int32))
        try:
            _wait_xfer(self.agent, h, f"staged READ of {n} blocks")
        finally:
            self.agent.release_xfer_handle(h)
        t1 = time.perf_counter()
        view, staged = region_view(self.mem.buf, self.s.nb, layout), self._stage_view(n)
        if _torch(view):
            import torch

            with self._on_stream():
                view.index_copy_(1, torch.tensor(dst, device=view.device), staged)
            self._stream_sync()
        else:
            view[:, dst] = staged
        return t1 - t0, time.perf_counter() - t1

    def progress(self) -> None:
        self.agent.get_new_notifs()  # the target of a READ must progress in UCX peer mode

    def close(self) -> None:
        for m in (self.copy_src, self.stage, self.mem):
            if m is not None:
                m.close()


def _serve(spec: Spec, conn: Any, tensor: Any = None) -> None:
    os.environ.update(spec.env)  # before NIXL (and UCX) load
    try:
        w = _Worker(spec, tensor)
        conn.send(("ok", w.hello()))
    except BaseException as e:
        conn.send(("unavailable" if isinstance(e, Unavailable) else "err", f"{type(e).__name__}: {e}",
                   traceback.format_exc()[-2000:]))
        return
    try:
        while True:
            if not conn.poll(0.0002):
                w.progress()
                continue
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send(("ok", getattr(w, cmd)(*args)))
            except Exception as e:
                conn.send(("err", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:]))
    finally:
        w.close()
        with contextlib.suppress(OSError):  # (the driver may be gone already)
            conn.send(("ok", None))


class WorkerError(RuntimeError):
    pass


class Pair:
    """A raw-NIXL target and initiator, each in its own process, driven from here."""

    def __init__(self, kind: str, nb: int, *, device: str = "cuda:0", mode: str = "peer", threads: int = 2,
                 env: dict[str, str] | None = None, stage_blocks: int = 0) -> None:
        self.kind, self.nb = kind, nb
        env = dict(env or {})
        if kind not in ("dram", "torch_cpu"):
            env.setdefault("UCX_MEMTYPE_CACHE", "n")  # as kvxfer's sidecars run with --cuda on
        self.env = env
        tensors: list[Any] = [None, None]
        if kind == "ipc_imported":  # this process plays both engines; the workers import their memory
            import torch
            import torch.multiprocessing as tmp

            ctx: Any = tmp.get_context("spawn")
            self._keep = [torch.zeros(nb * BLOCK, dtype=torch.uint8, device=device) for _ in range(2)]
            tensors = list(self._keep)
        else:
            ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.hello: list[dict[str, Any]] = []
        try:
            for role, t in zip(("target", "initiator"), tensors, strict=True):
                a, b = ctx.Pipe()
                spec = Spec(role, kind, nb, stage_blocks, device, mode, threads, env)
                p = ctx.Process(target=_serve, args=(spec, b, t), daemon=True)
                p.start()
                self.procs.append(p)
                self.conns.append(a)
            for i in range(2):
                self.hello.append(self._answer(i, "start", CALL_TIMEOUT_S))
            self.call(1, "connect", self.hello[0])
        except BaseException:
            self.close()
            raise

    def _answer(self, i: int, what: str, timeout: float) -> Any:
        conn, proc = self.conns[i], self.procs[i]
        if not conn.poll(timeout):
            raise WorkerError(f"the {('target', 'initiator')[i]} did not answer {what!r} in {timeout:.0f} s "
                              f"(alive: {proc.is_alive()}, exit code {proc.exitcode})")
        try:
            got = conn.recv()
        except EOFError as e:
            raise WorkerError(f"the {('target', 'initiator')[i]} died during {what!r} "
                              f"(exit code {proc.exitcode})") from e
        if got[0] == "unavailable":
            raise Unavailable(got[1])
        if got[0] != "ok":
            raise WorkerError(f"{what}: {got[1]}\n{got[2]}")
        return got[1]

    def call(self, i: int, cmd: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.conns[i].send((cmd, args))
        return self._answer(i, cmd, timeout)

    def target(self, cmd: str, *args: Any) -> Any:
        return self.call(0, cmd, *args)

    def initiator(self, cmd: str, *args: Any) -> Any:
        return self.call(1, cmd, *args)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("stop", ()))
        for p in self.procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.procs, self.conns = [], []

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- lanes


def block_ids(nb: int, seed: int) -> list[int]:
    """Non-contiguous block ids, as a busy engine hands them out (block 0 is vLLM's null block)."""
    ids = list(range(1, nb))
    random.Random(seed).shuffle(ids)
    return ids


def lanes_one(kind: str, device: str, mode: str) -> dict[str, Any]:
    """One READ and one WRITE between two processes holding ``kind`` memory, both verified
    (run with UCX_PROTO_INFO=y: UCX prints the lane it chose for each)."""
    nb = 10
    s, d = block_ids(nb, 1)[:4], block_ids(nb, 2)[:4]
    with Pair(kind, nb, device=device, mode=mode) as pair:
        pair.target("fill", 1)
        pair.initiator("fill", 2)
        t_read = pair.initiator("xfer", "READ", "LBNHC", s, d)
        bad_read = pair.initiator("verify", 1, s, d, "LBNHC")
        pair.initiator("fill", 2)  # (the READ landed in some of the blocks written next)
        t_write = pair.initiator("xfer", "WRITE", "LBNHC", s, d)
        bad_write = pair.target("verify", 2, s, d, "LBNHC")
        time.sleep(0.2)  # (UCX prints the WRITE's table from its progress: let it flush)
        return {"kind": kind, "memory": {"target": pair.hello[0]["info"], "initiator": pair.hello[1]["info"]},
                "read_ms": round(t_read * 1e3, 3), "write_ms": round(t_write * 1e3, 3),
                "read_verified": bad_read == 0, "write_verified": bad_write == 0}


_UCX_LINE = re.compile(r"^\[[\d.]+\]\s+\[[^:\]]*:(\d+)\s*:\d+\]\s*(.*)$")
_OP = re.compile(r"remote memory (read|write) by (ucp_\w+\*?(?:\([^)]*\))?)\s*(.*)$")
_TL = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.-]+")


def parse_proto_info(text: str) -> dict[str, Any]:
    """What UCX_PROTO_INFO=y printed about remote memory reads and writes: per table (one per
    process, operation and memory pair), its title and its rows (size range, protocol,
    lane), and per operation the transports named (``cuda_ipc``, ``cma``, ``tcp``...).

    UCX prints a table as a box, each line prefixed with ``[time] [host:pid:thread]``: lines
    are grouped by pid first, since two processes print at once."""
    by_pid: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _UCX_LINE.match(line.strip())
        if m and "|" in m.group(2):
            by_pid.setdefault(m.group(1), []).append(m.group(2))
    tables: list[dict[str, Any]] = []
    for pid, lines in by_pid.items():
        cur: dict[str, Any] | None = None
        scope = ""
        for line in lines:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 1:
                op = _OP.search(cells[0])
                if op:
                    cur = {"pid": pid, "scope": scope, "op": op.group(1), "call": op.group(2),
                           "memory": op.group(3), "rows": [], "transports": []}
                    tables.append(cur)
                else:
                    scope, cur = cells[0], None
                continue
            if cur is None or cells[0].lower() == "range":
                continue
            cur["rows"].append(" | ".join(cells)[:200])
            for tl in _TL.findall(cells[-1]):
                if tl not in cur["transports"]:
                    cur["transports"].append(tl)
    unique: dict[str, dict[str, Any]] = {}
    for t in tables:  # (UCX prints a table again for each endpoint configuration)
        unique.setdefault(json.dumps({**t, "pid": ""}, sort_keys=True), t)
    tables = list(unique.values())
    # the lanes of the transfers themselves: the initiator's tables to its peer (not loopback)
    mine = [t for t in tables if "initiator" in t["scope"] and " self " not in f" {t['scope']} "] or tables
    ops: dict[str, list[str]] = {"read": [], "write": []}
    for t in mine:
        for tl in t["transports"]:
            if tl not in ops[t["op"]]:
                ops[t["op"]].append(tl)
    return {"read": ops["read"], "write": ops["write"], "tables": tables[:16]}


def _lanes_main(kind: str, device: str) -> int:
    try:
        one: dict[str, Any] = {"status": "ok", **lanes_one(kind, device, "peer")}
        if not (one["read_verified"] and one["write_verified"]):
            one["status"] = "failed"
            one["reason"] = "bytes differ after the transfer"
    except Unavailable as e:
        one = {"status": "unavailable", "reason": str(e)}
    except Exception as e:
        one = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:3000]}
    print("GPU-CHECK-RESULT " + json.dumps(one), flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["lanes-one"])
    ap.add_argument("kind")
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    raise SystemExit(_lanes_main(a.kind, a.device))
