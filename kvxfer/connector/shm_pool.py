"""Put a CPU engine's KV cache in named shared memory, without a copy.

``SharedAllocator`` is the context ``get_mem_pool_context`` returns on a CPU engine: while
it is active, ``torch.zeros``/``torch.empty`` on the CPU above ``min_bytes`` are served by
``torch.from_file(path, shared=True)`` on a fresh 0600 file, so the sidecar can map the
very pages the engine computes into. ``lookup`` finds the file behind a tensor later
(``register_kv_caches``). Files are removed by ``close`` (connector shutdown).
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

from kvxfer.protocol import ShmMemory

_PAGE = 4096


@dataclass(frozen=True)
class ShmAllocation:
    path: str
    addr: int
    nbytes: int


def _is_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


class SharedAllocator(TorchFunctionMode):
    def __init__(self, directory: str = "/dev/shm", min_bytes: int = 1 << 16) -> None:
        super().__init__()
        self.directory = directory
        self.min_bytes = min_bytes
        self.allocations: list[ShmAllocation] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and _is_cpu(kwargs.get("device")):
            size = args[0] if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size) else args
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            numel = math.prod(int(s) for s in size)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if nbytes >= self.min_bytes and not kwargs.get("out") and not kwargs.get("requires_grad"):
                return self._allocate(tuple(int(s) for s in size), dtype, numel, nbytes, kwargs)
        return func(*args, **kwargs)

    def _allocate(
        self, size: tuple[int, ...], dtype: torch.dtype, numel: int, nbytes: int, kwargs: dict[str, Any]
    ) -> torch.Tensor:
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
            pass  # shared file pages cannot be pinned by torch; NIXL registers them itself
        self.allocations.append(ShmAllocation(path, tensor.data_ptr(), nbytes))
        return tensor

    def lookup(self, tensor: torch.Tensor) -> tuple[ShmMemory, int] | None:
        """The shm file behind ``tensor`` and the tensor's byte offset in it."""
        ptr = tensor.data_ptr()
        for a in self.allocations:
            if a.addr <= ptr < a.addr + a.nbytes:
                return ShmMemory(path=a.path, size=a.nbytes), ptr - a.addr
        return None

    def close(self) -> None:
        for a in self.allocations:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(a.path)
        self.allocations.clear()
