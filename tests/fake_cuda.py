"""A stand-in for ``cuda.bindings.driver``'s VMM calls, for unit tests of ``kvxfer.vmm`` on a
machine without a GPU. It is not evidence that the GPU path works: it checks our use of
the API (call order, sizes, handle and mapping lifetimes, fd passing) against the
documented semantics, with host memfds standing in for device memory so that two
"processes" (two ``Vmm`` objects) that import the same fd see the same bytes.

Every call returns ``(CUresult, *values)`` as the real module's do, and is logged in
``calls`` (name, argument count) so a test can hold the names and arities against the real
module where ``cuda-bindings`` is installed.
"""

from __future__ import annotations

import enum
import mmap
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUdevice_attribute(enum.IntEnum):  # noqa: N801 (the driver's names)
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_FABRIC = 8


class CUpointer_attribute(enum.IntEnum):  # noqa: N801
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = 0
        self.location = SimpleNamespace(type=0, id=0)
        self.requestedHandleTypes = 0
        self.allocFlags = SimpleNamespace(gpuDirectRDMACapable=0)


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = SimpleNamespace(type=0, id=0)
        self.flags = 0


_NAME = "fake-vram"
OK = (CUresult.CUDA_SUCCESS,)


@dataclass
class FakeDriver:
    """One "process"'s view of the driver. ``attrs`` overrides device attributes; with
    ``fabric_permitted=False`` a fabric-handle allocation fails as without an IMEX channel."""

    granularity: int = 2 << 20
    free: int = 80 << 30
    attrs: dict[int, int] = field(default_factory=dict)
    fabric_permitted: bool = False
    no_library: bool = False
    uuids: list[bytes] = field(default_factory=lambda: [bytes([0xA0 + i] * 16) for i in range(2)])
    ctx_stack: list[int] = field(default_factory=list)  # this thread's current context, last
    synced: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)
    handles: dict[int, int] = field(default_factory=dict)  # handle -> memfd (its reference)
    reserved: dict[int, int] = field(default_factory=dict)  # va -> size
    mapped: dict[int, mmap.mmap] = field(default_factory=dict)  # va -> the memory
    access: dict[int, tuple[int, int]] = field(default_factory=dict)  # va -> (device, flags)
    created: list[CUmemAllocationProp] = field(default_factory=list)
    allocs: dict[int, int] = field(default_factory=dict)  # cuMemAlloc'ed pointer -> size
    _next: int = 1

    # the enums and structs, as attributes of the module
    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc
    CUpointer_attribute = CUpointer_attribute

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, len(args)))

    def _id(self) -> int:
        self._next += 1
        return self._next << 32

    def view(self, va: int) -> mmap.mmap:
        """The memory mapped at ``va`` (what a kernel on the device would see)."""
        return self.mapped[va]

    # --------------------------------------------------------------- the calls

    def cuGetErrorName(self, err: Any) -> tuple[Any, bytes]:  # noqa: N802
        self._log("cuGetErrorName", err)
        return CUresult.CUDA_SUCCESS, CUresult(err).name.encode()

    def cuInit(self, flags: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuInit", flags)
        if self.no_library:
            raise OSError('"cuda" is an NVIDIA driver library and can only be found via system search')
        return OK

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, int]:  # noqa: N802
        self._log("cuDeviceGet", ordinal)
        return CUresult.CUDA_SUCCESS, ordinal

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, int]:  # noqa: N802
        self._log("cuDevicePrimaryCtxRetain", dev)
        return CUresult.CUDA_SUCCESS, 1000 + dev

    def cuCtxGetCurrent(self) -> tuple[Any, int | None]:  # noqa: N802
        self._log("cuCtxGetCurrent")
        return CUresult.CUDA_SUCCESS, (self.ctx_stack[-1] if self.ctx_stack else None)

    def cuCtxPushCurrent(self, ctx: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuCtxPushCurrent", ctx)
        self.ctx_stack.append(ctx)
        return OK

    def cuCtxPopCurrent(self) -> tuple[Any, int]:  # noqa: N802
        self._log("cuCtxPopCurrent")
        return CUresult.CUDA_SUCCESS, self.ctx_stack.pop()

    def cuCtxSynchronize(self) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuCtxSynchronize")
        self.synced += 1
        return OK

    def _device(self) -> int:
        """The device of the current context (calls that need one fail without it)."""
        if not self.ctx_stack:
            raise AssertionError("a driver call that needs a current context ran without one")
        return self.ctx_stack[-1] - 1000

    def cuDeviceGetCount(self) -> tuple[Any, int]:  # noqa: N802
        self._log("cuDeviceGetCount")
        return CUresult.CUDA_SUCCESS, len(self.uuids)

    def cuDeviceGetUuid(self, dev: int) -> tuple[Any, Any]:  # noqa: N802
        self._log("cuDeviceGetUuid", dev)
        return CUresult.CUDA_SUCCESS, SimpleNamespace(bytes=self.uuids[dev])

    def cuDeviceGetAttribute(self, attrib: Any, dev: int) -> tuple[Any, int]:  # noqa: N802
        self._log("cuDeviceGetAttribute", attrib, dev)
        return CUresult.CUDA_SUCCESS, self.attrs.get(int(attrib), 1)

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, int]:  # noqa: N802
        self._log("cuMemGetAllocationGranularity", prop, option)
        return CUresult.CUDA_SUCCESS, self.granularity

    def cuMemGetInfo(self) -> tuple[Any, int, int]:  # noqa: N802
        self._log("cuMemGetInfo")
        return CUresult.CUDA_SUCCESS, self.free, 80 << 30

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemCreate", size, prop, flags)
        if size % self.granularity:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if prop.requestedHandleTypes & CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC and \
                not self.fabric_permitted:
            return (CUresult.CUDA_ERROR_NOT_PERMITTED,)
        if size > self.free:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        self._device()
        self.created.append(prop)
        fd = os.memfd_create(f"{_NAME}-gpu{prop.location.id}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        h = self._id()
        self.handles[h] = fd
        return CUresult.CUDA_SUCCESS, h

    def cuMemExportToShareableHandle(self, handle: int, kind: Any, flags: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemExportToShareableHandle", handle, kind, flags)
        posix = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if handle not in self.handles or kind != posix:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        fd = os.dup(self.handles[handle])
        os.set_inheritable(fd, True)  # (the real driver's fd is not close-on-exec either)
        return CUresult.CUDA_SUCCESS, fd

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemImportFromShareableHandle", fd, kind)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if not target.startswith(f"/memfd:{_NAME}"):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # not a VMM allocation
        h = self._id()
        self.handles[h] = os.dup(fd)
        return CUresult.CUDA_SUCCESS, h

    def cuMemGetAllocationPropertiesFromHandle(self, handle: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemGetAllocationPropertiesFromHandle", handle)
        if handle not in self.handles:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        name = os.readlink(f"/proc/self/fd/{self.handles[handle]}")
        prop = CUmemAllocationProp()
        prop.location.id = int(name.split("-gpu")[1].split(" ")[0])
        return CUresult.CUDA_SUCCESS, prop

    def cuMemAlloc(self, size: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemAlloc", size)
        if not self.ctx_stack:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # (no current context)
        if size > self.free:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        ptr = self._id()
        self.allocs[ptr] = size
        return CUresult.CUDA_SUCCESS, ptr

    def cuMemFree(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemFree", ptr)
        return OK if self.allocs.pop(int(ptr), None) is not None else (CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuPointerGetAttribute(self, attribute: Any, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuPointerGetAttribute", attribute, ptr)
        if int(attribute) != CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return CUresult.CUDA_SUCCESS, int(int(ptr) in self.allocs)  # (cuMemAlloc'ed memory: capable)

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemRelease", handle)
        fd = self.handles.pop(handle, None)
        if fd is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        os.close(fd)  # a mapping made from it keeps the memory (its own reference)
        return OK

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemAddressReserve", size, alignment, addr, flags)
        if size % self.granularity or alignment % self.granularity:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        va = self._id()
        self.reserved[va] = size
        return CUresult.CUDA_SUCCESS, va

    def cuMemMap(self, va: int, size: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemMap", va, size, offset, handle, flags)
        self._device()
        if size % self.granularity or offset % self.granularity:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if va not in self.reserved or handle not in self.handles or size > self.reserved[va]:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if offset + size > os.fstat(self.handles[handle]).st_size:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # past the end of the allocation
        self.mapped[va] = mmap.mmap(self.handles[handle], size, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        return OK

    def cuMemSetAccess(self, va: int, size: int, desc: list[Any], count: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemSetAccess", va, size, desc, count)
        if size % self.granularity:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if va not in self.mapped or count != len(desc):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.access[va] = (desc[0].location.id, int(desc[0].flags))
        return OK

    def cuMemUnmap(self, va: int, size: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemUnmap", va, size)
        self._device()
        mm = self.mapped.pop(va, None)
        if mm is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        mm.close()
        self.access.pop(va, None)
        return OK

    def cuMemAddressFree(self, va: int, size: int) -> tuple[Any, ...]:  # noqa: N802
        self._log("cuMemAddressFree", va, size)
        if self.reserved.pop(va, None) is None or va in self.mapped:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return OK

    def leaks(self) -> dict[str, int]:
        return {"handles": len(self.handles), "reserved": len(self.reserved), "mapped": len(self.mapped),
                "contexts_left_current": len(self.ctx_stack)}
