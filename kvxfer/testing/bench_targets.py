"""``kvxfer bench``'s geometry and what kvxfer is measured against: raw NIXL (``RawNixl``,
a second process's agent mapping the prefill engine's memory), memcpy of the same blocks, and
the check that the bytes arrived."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from kvxfer.memory import CudaKV, SharedKV
from kvxfer.protocol import KVLayout
from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.sidecar.plan import desc_indices, merge_rows, strided_rows
from kvxfer.testing.engine import SyntheticEngine, make_layout

BLOCK_BYTES = 2 << 20  # 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16


BENCH_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")  # vLLM's names: BL... = block-outermost


def _layout(num_blocks: int, kv_layout: str = "LBNHC") -> KVLayout:
    return make_layout(layers=32, num_blocks=num_blocks, block_size=16, heads=8, head_dim=128,
                       head_layout="HND" if "HN" in kv_layout else "NHD")


def _raw_target(ref: bytes, mode: str, threads: int, conn: Any) -> None:
    """The prefill side of raw NIXL: open the engine's memory (the shm file or the CUDA IPC
    handle the sidecar gets), register it, make progress until told to stop."""
    import msgspec

    from kvxfer.protocol import MemoryRef
    from kvxfer.sidecar.mapping import map_memory

    if isinstance(ref, str):  # a pool: the parent's memfd, opened through /proc
        from kvxfer.memchannel import map_fd
        from kvxfer.sidecar.mapping import host_mapping

        fd = os.open(ref, os.O_RDWR)
        try:
            m = host_mapping(map_fd(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    else:
        m = map_memory(msgspec.msgpack.decode(ref, type=MemoryRef))  # type: ignore[arg-type]
    agent = create_agent("raw-target", mode, threads)
    agent.register_memory([(m.addr, m.size, m.device_id, "")], m.mem_type)
    conn.send((bytes(agent.get_agent_metadata()), m.addr, m.device_id, m.mem_type))
    while not conn.poll(0.001):
        agent.get_new_notifs()  # the target of a READ must progress in UCX peer mode
    conn.recv()


def _local_memory(kv: SharedKV | CudaKV) -> tuple[int, int, str]:
    """(address, device id, NIXL memory type) of a KV cache this process owns."""
    if isinstance(kv, SharedKV):
        return int(kv.data.ctypes.data), 0, "DRAM"
    return int(kv.tensor.data_ptr()), int(kv.tensor.device.index or 0), "VRAM"


class RawNixl:
    def __init__(self, src: SharedKV | CudaKV, dst: SharedKV | CudaKV, mode: str, threads: int = 0) -> None:
        import msgspec

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        (ref,) = src.register_message().memory
        pool = getattr(src, "pool", None)
        arg: bytes | str = (f"/proc/{os.getpid()}/fd/{pool.fd}" if pool is not None
                            else msgspec.msgpack.encode(ref))
        self.proc = ctx.Process(target=_raw_target, args=(arg, mode, threads, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError(f"the raw NIXL target did not start (exit code {self.proc.exitcode})")
        md, remote_addr, remote_dev, mem_type = self.conn.recv()
        self.agent = create_agent("raw-init", mode, threads)
        local_addr, local_dev, local_type = _local_memory(dst)
        self.agent.register_memory([(local_addr, dst.nbytes, local_dev, "")], local_type)
        name = self.agent.add_remote_agent(md)
        name = name.decode() if isinstance(name, bytes) else name
        lay = dst.layout
        reg = dst.register_message().regions
        from kvxfer.protocol import RemoteRegion

        def rows(base: int, dev: int) -> list[RemoteRegion]:
            return [RemoteRegion(addr=base + r.offset, block_len=r.block_len, block_stride=r.block_stride,
                                 device_id=dev) for r in reg]

        # the rows the sidecar reads (regions touching inside a block merged: same descriptors)
        pairs = zip(rows(local_addr, local_dev), rows(remote_addr, remote_dev), strict=True)
        merged = merge_rows(list(pairs))
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", strided_rows([a for a, _ in merged], lay.num_blocks), local_type)
        self.remote = self.agent.prep_xfer_dlist(name, strided_rows([b for _, b in merged], lay.num_blocks),
                                                 mem_type)
        self.regions = np.arange(len(merged))
        self.nb = lay.num_blocks

    def read(self, src_blocks: list[int], dst_blocks: list[int]) -> float:
        li = desc_indices(self.regions, self.nb, np.asarray(dst_blocks))
        ri = desc_indices(self.regions, self.nb, np.asarray(src_blocks))
        t0 = time.perf_counter()
        h = self.agent.make_prepped_xfer("READ", self.local, li, self.remote, ri)
        state = self.agent.transfer(h)
        while state == "PROC":
            time.sleep(20e-6)
            state = self.agent.check_xfer_state(h)
        took = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended in {state}")
        return took

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


def _memcpy(src: SharedKV | CudaKV, dst: SharedKV | CudaKV, src_blocks: list[int],
            dst_blocks: list[int]) -> float:
    s, d = src.blocks(), dst.blocks()
    if isinstance(src, CudaKV):  # one gather/scatter kernel pair on the GPU
        import torch

        si = torch.tensor(src_blocks, device=s.device)
        di = torch.tensor(dst_blocks, device=d.device)
        torch.cuda.synchronize(s.device)
        t0 = time.perf_counter()
        d[:, :, di] = s[:, :, si]
        torch.cuda.synchronize(s.device)
        return time.perf_counter() - t0
    if isinstance(src, SharedKV) and src.block_outer and isinstance(dst, SharedKV) and dst.block_outer:
        lay = src.layout  # a block of every layer is one run: copy it as one
        n = lay.num_regions * lay.region_block_len
        s = src.data[:n * lay.num_blocks].reshape(lay.num_blocks, n)
        d = dst.data[:n * lay.num_blocks].reshape(lay.num_blocks, n)
    t0 = time.perf_counter()
    for a, b in zip(src_blocks, dst_blocks, strict=True):
        d[..., b, :] = s[..., a, :]
    return time.perf_counter() - t0


def _check(p: SyntheticEngine, d: SyntheticEngine, pb: list[int], db: list[int], what: str) -> None:
    src, dst = p.kv.blocks()[:, :, pb], d.kv.blocks()[:, :, db]
    same = np.array_equal(src, dst) if isinstance(src, np.ndarray) else bool((src == dst).all().item())
    if not same:
        raise RuntimeError(f"{what}: received bytes differ")
