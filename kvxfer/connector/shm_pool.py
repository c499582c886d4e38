"""Put a CPU engine's KV cache in memory the sidecar owns, without a copy.

``SharedAllocator`` is the context ``get_mem_pool_context`` returns on a CPU engine: while
it is active, ``torch.zeros``/``torch.empty`` on the CPU above ``min_bytes`` are served from
a pool the sidecar creates on its memory channel (``kvxfer.pool``: a sealed memfd passed by
fd, mapped here), so the sidecar reads the very pages the engine computes into and nothing
is named in /dev/shm: a killed engine leaves nothing behind. ``lookup`` finds the pool
behind a tensor later (``register_kv_caches``). Without a pool client (no sidecar memory
channel) it falls back to the legacy engine-owned 0600 file under ``directory``.
vLLM-free; torch only.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvxfer.memory import cuda_ordinal, gpu_pool_tensor
from kvxfer.pool import Pool, PoolClient
from kvxfer.protocol import PoolMemory, ShmMemory

_PAGE = 4096


@dataclass(frozen=True)
class ShmAllocation:
    path: str  # "" in a pool
    addr: int
    nbytes: int
    pool: Pool | None = None

    def ref(self) -> ShmMemory | PoolMemory:
        if self.pool is not None:
            return PoolMemory(pool=self.pool.id, size=self.nbytes)
        return ShmMemory(path=self.path, size=self.nbytes)


def _is_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


class SharedAllocator(TorchFunctionMode):
    """``gpu``: a CUDA device index whose allocations come from the sidecar's VMM pools
    instead (``kvxfer.vmm``; not yet run on a GPU); None: host allocations only."""

    def __init__(self, directory: str = "/dev/shm", min_bytes: int = 1 << 16,
                 pools: PoolClient | None = None, gpu: int | None = None) -> None:
        super().__init__()
        self.pools = pools
        self.directory = directory
        self.min_bytes = min_bytes
        self.gpu = gpu
        self.allocations: list[ShmAllocation] = []

    def _ours(self, device: Any) -> bool:
        if self.gpu is None:
            return _is_cpu(device)
        return device is not None and cuda_ordinal(device) == self.gpu

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and self._ours(kwargs.get("device")):
            size = args[0] if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size) else args
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            numel = math.prod(int(s) for s in size)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if nbytes >= self.min_bytes and not kwargs.get("out") and not kwargs.get("requires_grad"):
                if self.gpu is not None:
                    return self._allocate_gpu(tuple(int(s) for s in size), dtype, nbytes, func is torch.zeros)
                return self._allocate(tuple(int(s) for s in size), dtype, numel, nbytes, kwargs)
        return func(*args, **kwargs)

    def _allocate_gpu(self, size: tuple[int, ...], dtype: torch.dtype, nbytes: int,
                      zero: bool) -> torch.Tensor:
        assert self.pools is not None
        assert self.gpu is not None
        pool, flat = gpu_pool_tensor(self.pools, nbytes, f"torch {list(size)} {dtype}", self.gpu, zero)
        tensor = flat.view(dtype).view(size)
        self.allocations.append(ShmAllocation("", tensor.data_ptr(), nbytes, pool))
        return tensor

    def _allocate(
        self, size: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        if self.pools is not None:
            pool = self.pools.create(nbytes, label=f"torch {list(size)} {dtype}")
            # (inside __torch_function__ this mode is off: frombuffer does not come back here)
            flat = torch.frombuffer(pool.map(), dtype=torch.uint8, count=nbytes).view(dtype)
            path = ""
        else:
            pool = None
            path = os.path.join(self.directory, f"kvxfer-kv-{os.getpid()}-{secrets.token_hex(6)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        flat.view(torch.uint8)[::_PAGE] = 0  # pre-touch: first writes into fresh pages are 25x slower
        tensor = flat.view(size)
        if kwargs.get("pin_memory"):
            pass  # shared pages cannot be pinned by torch; NIXL registers them itself
        self.allocations.append(ShmAllocation(path, tensor.data_ptr(), nbytes, pool))
        return tensor

    def lookup(self, tensor: torch.Tensor) -> tuple[ShmMemory | PoolMemory, int] | None:
        """The pool (or shm file) behind ``tensor`` and the tensor's byte offset in it."""
        ptr = tensor.data_ptr()
        for a in self.allocations:
            if a.addr <= ptr < a.addr + a.nbytes:
                return a.ref(), ptr - a.addr
        return None

    def close(self) -> None:
        for a in self.allocations:
            if a.pool is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(a.path)
        self.allocations.clear()
        if self.pools is not None:
            self.pools.close()  # our mappings go with the tensors; the sidecar lets go of its fds
