"""Sharing an engine's KV-cache memory with its sidecar: the engine side.

``SharedKV.create`` lays a paged KV cache out in a pool the sidecar owns (a sealed memfd
handed over the memory channel, ``kvxfer.pool``; nothing in /dev/shm), pre-touched so the
first transfer does not pay page faults (25-30x slower on never-touched pages), and
describes it as a ``RegisterKV`` message. Without a pool client it falls back to the legacy
engine-owned named file (a 0600 file created with O_EXCL under /dev/shm), which outlives a
killed engine. ``cuda_ipc_memory`` exports a CUDA tensor's storage.

The sidecar side (opening what a registration names) is ``kvxfer.sidecar.mapping``; this
module never imports it nor anything else of ``kvxfer.sidecar``. It never talks to NIXL;
torch is imported only on the CUDA path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.pool import Pool, PoolClient
from kvxfer.protocol import (
    CudaIpcMemory,
    KVLayout,
    KVRegion,
    MemoryRef,
    PoolMemory,
    RegisterKV,
    ShmMemory,
)

_PAGE = mmap.PAGESIZE


def region_block_len(layout: KVLayout) -> int:
    """Bytes of one block of one (layer, part) region for this rank."""
    return layout.region_block_len


def _dense_registration(layout: KVLayout, memory: MemoryRef, block_outer: bool = False) -> RegisterKV:
    """One memory holding ``[layers, kv_parts, num_blocks, block_len]`` densely (or, with
    ``block_outer``, ``[num_blocks, layers, kv_parts, block_len]``: vLLM's block-outermost
    layouts, a block of every layer one run), then ``[state_regions, num_blocks, state_bytes]``."""
    block_len = region_block_len(layout)
    span = layout.num_blocks * block_len
    if block_outer:
        regions = [KVRegion(memory=0, offset=i * block_len, block_len=block_len,
                            block_stride=layout.num_regions * block_len) for i in range(layout.num_regions)]
    else:
        regions = [
            KVRegion(memory=0, offset=i * span, block_len=block_len, block_stride=block_len)
            for i in range(layout.num_regions)
        ]
    base = layout.num_regions * span
    regions += [
        KVRegion(memory=0, offset=base + i * layout.num_blocks * layout.state_bytes,
                 block_len=layout.state_bytes, block_stride=layout.state_bytes)
        for i in range(layout.state_regions)
    ]
    return RegisterKV(layout=layout, memory=[memory], regions=regions)


def dense_bytes(layout: KVLayout) -> int:
    """Bytes of ``_dense_registration``'s memory."""
    return layout.num_blocks * (layout.num_regions * region_block_len(layout)
                                + layout.state_regions * layout.state_bytes)


@dataclass
class SharedKV:
    """A paged KV cache in one shared-memory file, laid out like vLLM's per-layer caches.

    Shape ``[num_layers, kv_parts, num_blocks, block_size, local_kv_heads, head_dim]``;
    region (layer, part) is contiguous, block b of it at ``b * block_len``. With
    ``block_outer`` the blocks are outermost (``[num_blocks, num_layers, kv_parts, ...]``, as
    vLLM's BLHNC/BLNHC): one block of every layer is one run.
    """

    layout: KVLayout
    path: str  # "" in a pool
    nbytes: int
    _mm: mmap.mmap
    _fd: int
    data: np.ndarray = field(repr=False)  # uint8 view of the whole file
    pool: Pool | None = None
    _pools: PoolClient | None = field(default=None, repr=False)
    block_outer: bool = False

    @classmethod
    def create(cls, layout: KVLayout, pools: PoolClient | None = None, directory: str = "/dev/shm",
               prefix: str = "kvxfer", block_outer: bool = False) -> SharedKV:
        """In a pool from ``pools`` (the sidecar's memory channel); without one, in a named
        file under ``directory`` (legacy: a killed engine leaves it behind)."""
        nbytes = dense_bytes(layout)
        if pools is not None:
            pool = pools.create(nbytes, label=f"kv tp{layout.tp_rank} pp{layout.pp_rank}")
            mm = pool.map()
            data = np.frombuffer(mm, dtype=np.uint8)
            data[::_PAGE] = 0  # pre-touch every page
            return cls(layout, "", nbytes, mm, -1, data, pool, pools, block_outer)
        path = os.path.join(directory, f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        data = np.frombuffer(mm, dtype=np.uint8)
        data[::_PAGE] = 0  # pre-touch every page
        return cls(layout, path, nbytes, mm, fd, data, block_outer=block_outer)

    def blocks(self) -> np.ndarray:
        """uint8 view ``[num_layers, kv_parts, num_blocks, block_len]`` (strided when
        ``block_outer``)."""
        lay = self.layout
        n = lay.num_regions * lay.num_blocks * lay.region_block_len
        if self.block_outer:
            return self.data[:n].reshape(lay.num_blocks, lay.num_layers, lay.kv_parts,
                                         lay.region_block_len).transpose(1, 2, 0, 3)
        return self.data[:n].reshape(lay.num_layers, lay.kv_parts, lay.num_blocks, lay.region_block_len)

    def state_blocks(self) -> np.ndarray:
        """uint8 view ``[state_regions, num_blocks, state_bytes]`` (after the KV)."""
        lay = self.layout
        n = lay.num_regions * lay.num_blocks * lay.region_block_len
        return self.data[n:].reshape(lay.state_regions, lay.num_blocks, lay.state_bytes)

    def register_message(self) -> RegisterKV:
        if self.pool is not None:
            return _dense_registration(self.layout, PoolMemory(pool=self.pool.id, size=self.nbytes),
                                       self.block_outer)
        return _dense_registration(self.layout, ShmMemory(path=self.path, size=self.nbytes), self.block_outer)

    def close(self) -> None:
        del self.data
        if self.pool is not None:
            assert self._pools is not None
            self._pools.free(self.pool)
            return
        with contextlib.suppress(BufferError):  # a caller still holds a view; freed at exit
            self._mm.close()
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass
class CudaKV:
    """The same paged layout as ``SharedKV``, in GPU memory: allocated by the engine and
    exported over CUDA IPC (legacy), or with ``pools`` in a CUDA VMM pool of the sidecar's
    (``kvxfer.vmm``; not yet run on a GPU).

    ``blocks()`` is a torch uint8 tensor ``[num_layers, kv_parts, num_blocks, block_len]``.
    The engine must keep this object alive while the sidecar has it registered.
    """

    layout: KVLayout
    nbytes: int
    tensor: Any = field(repr=False)
    pool: Pool | None = field(default=None, repr=False)
    _pools: PoolClient | None = field(default=None, repr=False)

    @classmethod
    def create(cls, layout: KVLayout, device: str = "cuda:0", pools: PoolClient | None = None) -> CudaKV:
        import torch

        block_len = region_block_len(layout)
        shape = (layout.num_layers, layout.kv_parts, layout.num_blocks, block_len)
        if pools is not None:
            nbytes = layout.num_regions * layout.num_blocks * block_len
            index = cuda_ordinal(device)
            assert index is not None
            pool, flat = gpu_pool_tensor(pools, nbytes, f"kv tp{layout.tp_rank} pp{layout.pp_rank}", index)
            return cls(layout, nbytes, flat.view(shape), pool, pools)
        tensor = torch.zeros(shape, dtype=torch.uint8, device=device)
        return cls(layout, tensor.numel(), tensor)

    def blocks(self) -> Any:
        return self.tensor

    def register_message(self) -> RegisterKV:
        if self.pool is not None:
            return _dense_registration(self.layout, PoolMemory(pool=self.pool.id, size=self.nbytes))
        return _dense_registration(self.layout, cuda_ipc_memory(self.tensor))

    def close(self) -> None:
        self.tensor = None
        if self.pool is not None and self._pools is not None:
            self._pools.free(self.pool)
            self.pool = None


def cuda_ordinal(device: Any) -> int | None:
    """The CUDA ordinal of a torch device ("cuda:1" -> 1, "cuda" -> the current one); None
    for any other device."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return None
    return d.index if d.index is not None else int(torch.cuda.current_device())


def gpu_pool_tensor(pools: PoolClient, nbytes: int, label: str, index: int,
                    zero: bool = True) -> tuple[Pool, Any]:
    """A GPU pool of ``nbytes`` from the sidecar on CUDA device ``index`` (named to it by
    UUID) and a flat uint8 tensor over it (keeping its mapping alive); zeroed (fresh VMM
    memory is not, unlike a fresh memfd) and synchronised before the sidecar or a peer
    touches it."""
    import torch

    pool = pools.create(nbytes, label=label, device=index,
                        device_uuid=str(torch.cuda.get_device_properties(index).uuid))
    flat = pool.map_gpu().tensor()[:nbytes]
    if zero:
        flat.zero_()
        torch.cuda.synchronize(index)
    return pool, flat


def cuda_ipc_memory(tensor: Any) -> CudaIpcMemory:
    """Export the storage behind a CUDA tensor for the sidecar to open (engine side)."""
    import torch

    storage = tensor.untyped_storage()
    (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = (
        storage._share_cuda_()
    )
    # _share_cuda_ describes the whole allocation block; point at this storage inside it.
    offset = int(offset)

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaIpcMemory(
        device_index=int(device),
        handle=bytes(handle),
        size=int(size),
        offset=int(offset),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=bytes(ev_handle) if ev_handle else b"",
        event_sync_required=bool(ev_sync),
        device_uuid=uuid,
    )
