"""Sharing an engine's KV-cache memory with its sidecar: the sidecar side.

``map_memory`` opens what a ``MemoryRef`` names (a file in /dev/shm, a CUDA IPC handle, or
a pool of the memory channel's, ``kvxfer.sidecar.pool_server``) and returns a ``Mapping``
(base address, size, NIXL memory type, device id) that stays valid until ``close()``.
``check_shm_files`` refuses, before anything is mapped, a file the sidecar cannot prove is
the engine's; and what is mapped must be the registering process's own: a pool it created
or handed back, a file it has open or mapped itself (checked on the very file opened, so a
path swapped meanwhile proves nothing). The engine side (laying a KV cache out and describing it) is
``kvxfer.memory``.

This module never talks to NIXL; torch is imported only on the CUDA path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.memchannel import map_fd
from kvxfer.protocol import (
    CudaIpcMemory,
    MemoryRef,
    PoolMemory,
    RegisterKV,
    ShmMemory,
)
from kvxfer.sidecar.ownership import Creds
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.sidecar.procfs import has_open
from kvxfer.vmm import uuid_key


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


def _map_shm(ref: ShmMemory, sender: Creds | None) -> Mapping:
    try:
        fd = os.open(ref.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RequestError(ErrorCode.MEMORY_MAP_FAILED, f"cannot open {ref.path!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(ErrorCode.INVALID_MEMORY, f"{ref.path!r} is not a regular file")
        if sender is not None and not has_open(sender.pid, st.st_dev, st.st_ino):
            whose = (f"the registering process ({sender}) has it neither open nor mapped" if sender.pid
                     else "the registering process is not visible from this sidecar")
            raise RequestError(ErrorCode.INVALID_MEMORY, f"shared memory {ref.path!r} refused: {whose}; "
                               "an engine registers only its own files (better: allocate the KV "
                               "cache from the memory channel's pools)")
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


def local_ordinal(device_index: int, device_uuid: str) -> int:
    """The sidecar's ordinal of the engine's GPU: by its UUID where the engine sent one
    (``CUDA_VISIBLE_DEVICES``, or a device plugin, may number the GPUs differently in the two
    processes: the engine's ``cuda:0`` can be the sidecar's ``cuda:3``), else the engine's."""
    if not device_uuid:
        return device_index
    import torch

    want = uuid_key(device_uuid)
    count = torch.cuda.device_count()
    for i in range(count):
        if uuid_key(str(torch.cuda.get_device_properties(i).uuid)) == want:
            return i
    raise RequestError(ErrorCode.INVALID_MEMORY, f"no GPU {device_uuid} visible to this sidecar "
                       f"({count} visible): check CUDA_VISIBLE_DEVICES on both sides")


def _map_cuda(ref: CudaIpcMemory) -> Mapping:
    try:
        device = local_ordinal(ref.device_index, ref.device_uuid)
        import torch

        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            ref.handle,
            ref.size,
            ref.offset,
            ref.ref_counter_handle,
            ref.ref_counter_offset,
            ref.event_handle or None,
            ref.event_sync_required,
        )
    except RequestError:
        raise
    except Exception as e:  # torch raises RuntimeError subclasses without a common root
        raise RequestError(ErrorCode.MEMORY_MAP_FAILED, f"cannot open CUDA IPC handle: {e}") from e
    return Mapping(
        addr=int(storage.data_ptr()),
        size=ref.size,
        mem_type="VRAM",
        device_id=device,
        _keep=[storage],
    )


def _map_pool(ref: PoolMemory, pools: PoolServer | None, sender: Creds | None) -> Mapping:
    if pools is None:
        raise RequestError(ErrorCode.INVALID_MEMORY, "this sidecar has no memory channel")
    fd, size, device = pools.dup(ref.pool, sender)
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


def map_memory(ref: MemoryRef, pools: PoolServer | None = None, sender: Creds | None = None) -> Mapping:
    """``sender``: the registering process, whose own memory ``ref`` must be (None: the caller
    vouches for it, as tools mapping their own memory do)."""
    if isinstance(ref, ShmMemory):
        return _map_shm(ref, sender)
    if isinstance(ref, PoolMemory):
        return _map_pool(ref, pools, sender)
    return _map_cuda(ref)


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


def check_shm_files(msg: RegisterKV, shm_dirs: list[str], uid: int = -1) -> None:
    """A registration may name only files the sidecar can prove belong to the engine: an
    absolute path with no symlink anywhere in it, inside one of ``shm_dirs`` (or a directory
    below one), named ``kvxfer-*``, a regular file owned by the engine's uid: ``uid``, the
    registering connection's as the kernel reported it (-1: unknown; then the claimed pid's,
    or the sidecar's own when that pid is not visible from here). The sidecar maps these
    read-write and may unlink them when their engine dies, so anything else is refused."""
    owner = uid if uid >= 0 else process_uid(msg.pid)
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
