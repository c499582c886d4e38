"""Raw NIXL for ``make gpu-check`` (``kvxfer.testing.gpu_check``): a target (the prefill
engine) and an initiator (the decode engine), each its own process owning (or importing)
its memory and one NIXL agent, the in-engine connector's arrangement, both driven over
pipes from this process (``Pair``). The memory, the byte pattern and the agents are
``gpu_xfer``'s; what the initiator can be told: fill, wipe, verify, READ or WRITE blocks
(``xfer``), the same-device copy, and the staged variant (gather into a contiguous buffer
on the sender's own CUDA stream, one transfer, scatter on the receiver's).

Every call to a worker process has a timeout (``CALL_TIMEOUT_S``) and every transfer a
deadline, so a stuck UCX lane is an error with a message, not a hang.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.sidecar.nixl_agent import cuda_ucx_defaults
from kvxfer.testing.gpu_xfer import (
    BLOCK,
    PIECE,
    REGIONS,
    Mem,
    Unavailable,
    _torch,
    _wait_xfer,
    alloc,
    copy_blocks,
    fill,
    indices,
    make_agent,
    region_view,
    strided,
    verify,
    wipe,
)

CALL_TIMEOUT_S = 120.0


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
            cuda_ucx_defaults(env)  # as kvxfer's sidecars run with --cuda on
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
