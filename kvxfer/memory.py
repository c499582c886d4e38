"""Sharing an engine's KV-cache memory with its sidecar.

Engine side: ``SharedKV.create`` lays a paged KV cache out in a pool the sidecar owns
(a sealed memfd handed over the memory channel, ``kvxfer.pool``; nothing in /dev/shm),
pre-touched so the first transfer does not pay page faults (25-30x slower on never-touched
pages), and describes it as a ``RegisterKV`` message. Without a pool client it falls back
to the legacy engine-owned named file (a 0600 file created with O_EXCL under /dev/shm),
which outlives a killed engine. ``cuda_ipc_memory`` exports a CUDA tensor's storage.

Sidecar side: ``map_memory`` opens what a ``MemoryRef`` names and returns a ``Mapping``
(base address, size, NIXL memory type, device id) that stays valid until ``close()``.

This module never talks to NIXL; torch is imported only on the CUDA path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.memchannel import map_fd
from kvxfer.pool import Pool, PoolClient
from kvxfer.protocol import (
    DTYPE_SIZES,
    CudaIpcMemory,
    KVLayout,
    KVRegion,
    MemoryRef,
    PoolMemory,
    RankInfo,
    RegisterKV,
    ShmMemory,
    compat_hash,
)
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.topology import Incompatible, check_layout

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


@dataclass
class Mapping:
    """Memory of one engine registration as the sidecar sees it."""

    addr: int
    size: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    _keep: list[Any] = field(default_factory=list, repr=False)
    _view: Any = field(default=None, repr=False)  # as_tensor(), cached

    def as_tensor(self) -> Any:
        """The whole mapping as uint8, for digests: a numpy array over host memory, a torch
        tensor over VRAM. Built once, dropped with the mapping."""
        if self._view is None:
            self._view = self._make_view()
        return self._view

    def _make_view(self) -> Any:
        if self.mem_type == "VRAM":
            import torch

            storage = self._keep[0]
            if hasattr(storage, "tensor"):  # a VMM pool's mapping (kvxfer.vmm.VmmMapping)
                return storage.tensor()
            return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.device_id}").set_(
                storage, 0, (self.size,), (1,))
        import ctypes

        return np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self.addr))

    def close(self) -> None:
        self._view = None
        keep, self._keep = self._keep, []
        for obj in reversed(keep):
            close = getattr(obj, "close", None)
            if close is not None:
                with contextlib.suppress(BufferError):
                    close()


def _map_shm(ref: ShmMemory) -> Mapping:
    try:
        fd = os.open(ref.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RequestError(ErrorCode.MEMORY_MAP_FAILED, f"cannot open {ref.path!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(ErrorCode.INVALID_MEMORY, f"{ref.path!r} is not a regular file")
        actual = st.st_size
        if actual < ref.size:
            raise RequestError(
                ErrorCode.MEMORY_MAP_FAILED,
                f"{ref.path!r} is {actual} bytes, registration claims {ref.size}",
            )
        # MAP_POPULATE: fill the page tables now. Otherwise the first read into (or from)
        # each page faults inside the copy: measured, 64 x 16 MiB receives into blocks
        # this sidecar had not touched yet took 0.67 s, the same ones again 0.30-0.36 s.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, ref.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return host_mapping(mm)


def host_mapping(mm: mmap.mmap) -> Mapping:
    """A ``Mapping`` of host memory mapped as ``mm`` (kept alive by the Mapping)."""
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = int(arr.ctypes.data)
    del arr
    # ctypes keeps no export; the mmap object itself is what must stay alive.
    return Mapping(addr=addr, size=len(mm), mem_type="DRAM", device_id=0, _keep=[mm])


def _map_cuda(ref: CudaIpcMemory) -> Mapping:
    try:
        import torch

        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            ref.device_index,
            ref.handle,
            ref.size,
            ref.offset,
            ref.ref_counter_handle,
            ref.ref_counter_offset,
            ref.event_handle or None,
            ref.event_sync_required,
        )
    except Exception as e:  # torch raises RuntimeError subclasses without a common root
        raise RequestError(ErrorCode.MEMORY_MAP_FAILED, f"cannot open CUDA IPC handle: {e}") from e
    return Mapping(
        addr=int(storage.data_ptr()),
        size=ref.size,
        mem_type="VRAM",
        device_id=ref.device_index,
        _keep=[storage],
    )


def _map_pool(ref: PoolMemory, pools: PoolServer | None) -> Mapping:
    if pools is None:
        raise RequestError(ErrorCode.INVALID_MEMORY, "this sidecar has no memory channel")
    fd, size, device = pools.dup(ref.pool)
    try:
        if ref.size > size:
            raise RequestError(ErrorCode.INVALID_MEMORY, f"pool {ref.pool[:8]} has {size} bytes, the "
                               f"registration claims {ref.size}")
        if device >= 0:  # a CUDA VMM allocation: NIXL registers it as VRAM of this process
            gpu = pools.gpu().import_fd(fd, ref.size, device)
            return Mapping(addr=gpu.va, size=ref.size, mem_type="VRAM", device_id=device, _keep=[gpu])
        # MAP_POPULATE, as for files: the first read into each page must not fault in the copy
        mm = map_fd(fd, ref.size)
    except OSError as e:
        raise RequestError(ErrorCode.MEMORY_MAP_FAILED, f"cannot map pool {ref.pool[:8]}: {e}") from e
    finally:
        os.close(fd)  # the mapping keeps the memory
    return host_mapping(mm)


def map_memory(ref: MemoryRef, pools: PoolServer | None = None) -> Mapping:
    if isinstance(ref, ShmMemory):
        return _map_shm(ref)
    if isinstance(ref, PoolMemory):
        return _map_pool(ref, pools)
    return _map_cuda(ref)


def validate_registration(msg: RegisterKV) -> None:
    """Check a registration's regions against its layout and memory sizes, before mapping."""
    lay = msg.layout
    if lay.dtype not in DTYPE_SIZES:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"unknown dtype {lay.dtype!r}")
    if lay.tp_rank >= lay.tp_size:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"tp_rank {lay.tp_rank} >= tp_size {lay.tp_size}")
    if lay.local_kv_heads > lay.num_kv_heads:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "local_kv_heads > num_kv_heads")
    if len(msg.regions) != lay.total_regions:
        raise RequestError(
            ErrorCode.INVALID_LAYOUT,
            f"{len(msg.regions)} regions for {lay.num_layers} layers x {lay.kv_parts} parts"
            + (f" + {lay.state_regions} state regions" if lay.state_regions else ""),
        )
    if bool(lay.state_regions) != bool(lay.state_bytes):
        raise RequestError(ErrorCode.INVALID_LAYOUT, "state_regions and state_bytes go together")
    if not lay.num_layers and not lay.state_regions:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "a registration with neither KV nor state layers")
    if not msg.memory:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "no memory in registration")
    for i, r in enumerate(msg.regions):
        want = lay.region_len(i)
        if r.block_len != want:
            what = (f"{lay.block_size} tokens x {lay.local_kv_heads} heads x {lay.head_dim} x "
                    f"{lay.itemsize} B, kv_parts={lay.kv_parts}, mla={lay.mla}, fused={lay.fused!r}"
                    if i < lay.num_regions else f"state of {lay.state_bytes} B")
            raise RequestError(
                ErrorCode.INVALID_LAYOUT,
                f"region {i}: a block is {r.block_len} bytes in memory, but the layout ({what}) "
                f"describes {want}",
            )
        if r.memory >= len(msg.memory):
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"region {i} names memory {r.memory}")
        if r.block_len > r.block_stride:
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"region {i}: block_len > block_stride")
        end = r.offset + (lay.num_blocks - 1) * r.block_stride + r.block_len
        if end > msg.memory[r.memory].size:
            raise RequestError(
                ErrorCode.INVALID_LAYOUT,
                f"region {i} ends at byte {end}, memory {r.memory} has {msg.memory[r.memory].size}",
            )


SHM_PREFIX = "kvxfer-"  # every KV file an engine shares with its sidecar is named so


def process_uid(pid: int) -> int | None:
    """The real uid of a process this sidecar can see (None: no pid, or not visible here)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_shm_files(msg: RegisterKV, shm_dirs: list[str]) -> None:
    """A registration may name only files the sidecar can prove belong to the engine: an
    absolute path with no symlink anywhere in it, inside one of ``shm_dirs`` (or a directory
    below one), named ``kvxfer-*``, a regular file owned by the engine's uid (the sidecar's
    own when the engine's pid is not visible from here). The sidecar maps these read-write
    and may unlink them when their engine dies, so anything else is refused."""
    owner = process_uid(msg.pid)
    want_uid = os.geteuid() if owner is None else owner
    roots = [os.path.realpath(d) for d in shm_dirs if d]
    for ref in msg.memory:
        if not isinstance(ref, ShmMemory):
            continue
        path = ref.path

        def refuse(why: str, path: str = path) -> RequestError:
            return RequestError(ErrorCode.INVALID_MEMORY, f"shared memory {path!r} refused: {why}")

        if not os.path.isabs(path) or os.path.normpath(path) != path:
            raise refuse("not an absolute, normalised path")
        if os.path.realpath(path) != path:
            raise refuse("a symlink in its path")
        if not any(os.path.dirname(path) == r or os.path.dirname(path).startswith(r + os.sep)
                   for r in roots):
            raise refuse(f"outside the shared-memory directories {roots} (shm_dirs)")
        if not os.path.basename(path).startswith(SHM_PREFIX):
            raise refuse(f"not a kvxfer file (its name must start with {SHM_PREFIX!r})")
        try:
            st = os.lstat(path)
        except OSError as e:
            raise refuse(str(e)) from None
        if not stat.S_ISREG(st.st_mode):
            raise refuse("not a regular file")
        if st.st_uid != want_uid:
            raise refuse(f"owned by uid {st.st_uid}, the engine runs as uid {want_uid}")


def validate_rank_info(info: RankInfo, compat: str) -> None:
    """Check a peer's advertised rank before its metadata is loaded or any descriptor is
    built from it, the way a local registration is checked: a layout that hashes to the
    compatibility hash agreed at the handshake and is self-consistent (ranks within sizes,
    heads as the TP split gives them, layers within the model), and regions that are blocks
    of exactly that geometry, not overlapping, within the address space. A peer holding the
    secret can still lie about *where* its blocks are; it then hands us its own bytes."""
    lay = info.layout
    who = f"peer rank pp{lay.pp_rank}/tp{lay.tp_rank}"
    if lay.dtype not in DTYPE_SIZES:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: unknown dtype {lay.dtype!r}")
    if lay.tp_rank >= lay.tp_size:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: tp_rank >= tp_size {lay.tp_size}")
    if lay.local_kv_heads > lay.num_kv_heads:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {lay.local_kv_heads} local KV heads of "
                           f"{lay.num_kv_heads}")
    if compat_hash(lay) != compat:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: its layout ({lay.model_signature()}) does "
                           f"not hash to the handshake's compatibility hash {compat}")
    try:
        check_layout(lay)
    except Incompatible as e:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {e}") from None
    if len(info.regions) != lay.total_regions:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {len(info.regions)} regions "
                           f"for {lay.num_layers} layers x {lay.kv_parts} parts + {lay.state_regions} state")
    if bool(lay.state_regions) != bool(lay.state_bytes):
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: state_regions and state_bytes go together")
    for i, r in enumerate(info.regions):
        if r.block_len != lay.region_len(i):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i} has {r.block_len}-byte "
                               f"blocks, its layout describes {lay.region_len(i)}")
        if r.block_stride < r.block_len:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i}'s blocks overlap "
                               f"(stride {r.block_stride} < {r.block_len} bytes)")
        if r.addr + (lay.num_blocks - 1) * r.block_stride + r.block_len > ADDRESS_LIMIT:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i} ends beyond the address space")


ADDRESS_LIMIT = 1 << 64
