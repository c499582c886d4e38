"""A stand-in CUDA driver with legacy IPC between processes (``kvxfer.testing.gpu_owner``'s
probe, run on a CPU): ``cuMemAlloc`` backs each allocation with a file under /dev/shm, its
IPC handle names the file and its owner's pid, and an opener maps the file. ``lose`` makes
an opened allocation unusable once its owner has exited (what a driver might do), else it
outlives the owner (what the probe hopes to see)."""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
from typing import Any

from tests.fake_cuda import OK, CUresult, FakeDriver

PREFIX = "/dev/shm/kvxfer-fakeipc-"


class CUipcMem_flags(enum.IntEnum):  # noqa: N801 (the driver's names)
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUipcMemHandle:
    """64 opaque bytes, reached through ``getPtr`` (as cuda-bindings 13 has it)."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:  # noqa: N802
        return ctypes.addressof(self._buf)


class IpcDriver(FakeDriver):
    CUipcMem_flags = CUipcMem_flags
    CUipcMemHandle = CUipcMemHandle

    def __init__(self, lose: bool = False) -> None:
        super().__init__()
        self.lose = lose
        self.mem: dict[int, tuple[mmap.mmap, int]] = {}  # pointer -> (its memory, its owner's pid)

    def cuMemAlloc(self, size: int) -> tuple[Any, ...]:  # noqa: N802
        ret = super().cuMemAlloc(size)
        if ret[0] == CUresult.CUDA_SUCCESS:
            path = f"{PREFIX}{os.getpid()}-{ret[1]}"
            with open(path, "w+b") as f:
                f.truncate(size)
                self.mem[ret[1]] = (mmap.mmap(f.fileno(), size), os.getpid())
        return ret

    def cuIpcGetMemHandle(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        h = CUipcMemHandle()
        ctypes.memmove(h.getPtr(), f"{os.getpid()}-{int(ptr)}".encode(), len(f"{os.getpid()}-{int(ptr)}"))
        return CUresult.CUDA_SUCCESS, h

    def cuIpcOpenMemHandle(self, h: CUipcMemHandle, flags: Any) -> tuple[Any, ...]:  # noqa: N802
        name = ctypes.string_at(h.getPtr()).decode()
        with open(PREFIX + name, "r+b") as f:
            m = mmap.mmap(f.fileno(), 0)
        os.unlink(PREFIX + name)  # (the mapping keeps it; nothing left behind)
        ptr = self._id()
        self.mem[ptr] = (m, int(name.split("-")[0]))
        return CUresult.CUDA_SUCCESS, ptr

    def cuIpcCloseMemHandle(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        self.mem.pop(int(ptr))[0].close()
        return OK

    def _memory(self, ptr: int) -> mmap.mmap | None:
        m, owner = self.mem[int(ptr)]
        return None if self.lose and owner != os.getpid() and not os.path.exists(f"/proc/{owner}") else m

    def cuMemsetD8(self, ptr: int, value: int, n: int) -> tuple[Any, ...]:  # noqa: N802
        m = self._memory(ptr)
        if m is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        m[:n] = bytes([value]) * n
        return OK

    def cuMemcpyDtoH(self, dst: int, ptr: int, n: int) -> tuple[Any, ...]:  # noqa: N802
        m = self._memory(ptr)
        if m is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, bytes(m[:n]), n)
        return OK


def keeps() -> IpcDriver:
    return IpcDriver(lose=False)


def loses() -> IpcDriver:
    return IpcDriver(lose=True)
