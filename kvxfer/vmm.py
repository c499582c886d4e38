"""GPU KV pools the sidecar owns: CUDA virtual memory management (VMM) through ``cuda.bindings``.

The GPU half of the memory channel (``kvxfer.memchannel``). The sidecar creates the physical
memory (``cuMemCreate``: pinned device memory, exportable as a POSIX fd, plus a fabric
handle where the driver allows one, ``gpuDirectRDMACapable`` where the device supports
GPUDirect RDMA on VMM memory, size rounded up to the allocation granularity), exports it as
a file descriptor and releases its own handle: from then on the fd is the allocation, as a
memfd is on the CPU, and it is passed to the engine with ``SCM_RIGHTS``. Whoever maps it
(the engine for its KV cache, the sidecar for its NIXL registration) imports the fd
(``cuMemImportFromShareableHandle``), reserves a virtual range, maps and enables access.
The driver frees the memory when the last fd, handle and mapping are gone: a killed engine
or sidecar leaks nothing, and memory that NIXL/UCX see was allocated through the VMM API
(UCX detects it as CUDA memory through ``cuMemRetainAllocationHandle``; legacy
``cuIpcOpenMemHandle`` memory is taken for host memory unless ``UCX_MEMTYPE_CACHE=n``).
Whether UCX's cuda_ipc transport can hand it to a peer on the same node depends on the UCX
build: POSIX-fd VMM handles only from UCX 1.22 (through ``pidfd_getfd``, which needs the
peer in the same PID namespace and a ptrace permission that Yama ``ptrace_scope=1`` denies
between unrelated processes), fabric handles earlier (which need an IMEX channel on the
machine). The UCX bundled with nixl-cu12 1.5.1 exports fabric handles only; without one the
pool still works, over whichever lane UCX picks. Which kind a pool got is logged.

Every call runs with the device's primary context pushed and popped again (never left
current on a thread torch also uses), and mappings are unmapped only after the context's
work is done (``cuMemUnmap`` does not synchronise in every case).

**This path has not run on a GPU.** It was written in a session without one, against the
``cuda.bindings`` API (import and struct construction are checked on a CPU) and a fake
driver in ``tests/test_vmm.py``; ``tests/test_gpu.py`` runs it where a GPU is present.

``cuda.bindings`` (the ``cuda-bindings`` package, ``pip install kvxfer[gpu]``) is imported
only when a GPU pool is asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import ErrorCode, RequestError

log = logging.getLogger(__name__)


class VmmUnavailable(RequestError):
    """No GPU pools here (no ``cuda.bindings``, no driver, or a device without VMM)."""

    def __init__(self, reason: str) -> None:
        super().__init__(ErrorCode.UNSUPPORTED, reason)


def align_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


@dataclass(frozen=True)
class Caps:
    """What a device offers VMM allocations."""

    vmm: bool
    posix_fd: bool
    fabric: bool
    rdma: bool  # GPUDirect RDMA on VMM memory


def uuid_key(uuid: str) -> str:
    """A GPU's UUID as hex digits alone, however printed ("GPU-" and dashes optional)."""
    return uuid.lower().removeprefix("gpu-").replace("-", "")


def _interface(ptr: int, size: int) -> dict[str, Any]:
    """``size`` bytes of device memory at ``ptr``, as ``__cuda_array_interface__`` says it."""
    return {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


def _view(obj: Any, ptr: int, device: int) -> Any:
    """``obj`` (device memory at ``ptr``) as a ``torch.uint8`` CUDA tensor: a view that keeps
    ``obj`` alive, never a copy (torch copies where the pointer's device is not ``device``)."""
    import torch

    with torch.cuda.device(device):  # (a thread with no current context: none made on GPU 0)
        t = torch.as_tensor(obj, device=f"cuda:{device}")
    if t.data_ptr() != ptr:
        raise RuntimeError(f"torch copied device memory at {ptr:#x} instead of viewing it")
    return t


@dataclass
class VmmMapping:
    """An imported allocation mapped at ``va`` in this process (readable and writable by
    ``device``). ``close()`` unmaps it; the memory lives on while other holders remain."""

    vmm: Vmm = field(repr=False)
    va: int
    size: int
    device: int
    closed: bool = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _interface(self.va, self.size)

    def tensor(self) -> Any:
        """The whole mapping as a ``torch.uint8`` CUDA tensor (no copy; keeps this alive)."""
        return _view(self, self.va, self.device)

    def close(self) -> None:
        """Unmap now (no tensor over it may be used after this)."""
        if not self.closed:
            self.closed = True
            self.vmm.unmap(self.va, self.size, self.device)

    def __del__(self) -> None:  # the last tensor over it (torch keeps a reference) is gone
        with contextlib.suppress(Exception):
            self.close()


@dataclass
class DeviceBuffer:
    """Device memory this process allocated (``Vmm.alloc_device``); ``close()`` frees it."""

    vmm: Vmm = field(repr=False)
    ptr: int
    size: int
    device: int
    legacy_ipc: bool  # (what the driver said: UCX exports it over cuda_ipc)
    closed: bool = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _interface(self.ptr, self.size)

    def tensor(self) -> Any:
        """The buffer as a ``torch.uint8`` CUDA tensor (no copy)."""
        return _view(self, self.ptr, self.device)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.vmm.free_device(self.ptr, self.device)


class Vmm:
    """The few driver calls the pools need. ``driver`` is ``cuda.bindings.driver`` (a fake
    in unit tests); every call returns ``(CUresult, *values)`` as that module's do."""

    def __init__(self, driver: Any = None) -> None:
        self.d = driver if driver is not None else _load_driver()
        self._lock = threading.RLock()  # (a finaliser may unmap on a thread already inside)
        self._ctx: dict[int, Any] = {}
        self._caps: dict[int, Caps] = {}
        self._gran: dict[int, int] = {}
        self._no_fabric: set[int] = set()  # devices where a fabric handle was refused once

    # ------------------------------------------------------------------ plumbing

    def _ok(self, ret: Any, what: str) -> Any:
        err, *vals = ret if isinstance(ret, tuple) else (ret,)
        if err != self.d.CUresult.CUDA_SUCCESS:
            code = (ErrorCode.OUT_OF_MEMORY if err == self.d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
                    else ErrorCode.MEMORY_MAP_FAILED)
            raise RequestError(code, f"{what}: {self._name(err)}")
        return vals[0] if len(vals) == 1 else tuple(vals)

    def _quietly(self, ret: Any, what: str) -> None:
        """A clean-up call on a failure path: log its error, never hide the first one."""
        try:
            self._ok(ret, what)
        except RequestError as e:
            log.warning("%s", e)

    def _name(self, err: Any) -> str:
        try:
            e, name = self.d.cuGetErrorName(err)
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # the name is only for the message
            return str(err)

    def _init(self) -> None:
        try:
            ret = self.d.cuInit(0)
        except Exception as e:  # cuda.bindings without a driver library raises here
            raise VmmUnavailable(f"no CUDA driver: {e}") from e
        if ret[0] != self.d.CUresult.CUDA_SUCCESS:
            raise VmmUnavailable(f"cuInit: {self._name(ret[0])}")

    def _primary(self, device: int) -> Any:
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                self._init()
                dev = self._ok(self.d.cuDeviceGet(device), f"cuDeviceGet({device})")
                ctx = self._ok(self.d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                self._ctx[device] = ctx
            return ctx

    @contextlib.contextmanager
    def context(self, device: int) -> Iterator[None]:
        """``device``'s primary context current on this thread for the block, and whatever
        was current before (torch's, on an engine) current again after it."""
        ctx = self._primary(device)
        current = self._ok(self.d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is not None and int(current) == int(ctx):
            yield
            return
        self._ok(self.d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._quietly(self.d.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def ordinal_of(self, uuid: str) -> int:
        """The ordinal, in this process, of the GPU with ``uuid`` (as torch or nvidia-smi
        print it: "GPU-" and dashes optional): CUDA_VISIBLE_DEVICES may differ between an
        engine and its sidecar, so an ordinal alone may name another GPU here."""
        want = uuid_key(uuid)
        with self._lock:
            self._init()
            count = int(self._ok(self.d.cuDeviceGetCount(), "cuDeviceGetCount"))
            for i in range(count):
                dev = self._ok(self.d.cuDeviceGet(i), "cuDeviceGet")
                got = self._ok(self.d.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
                if bytes(got.bytes).hex() == want:
                    return i
        raise RequestError(ErrorCode.INVALID_MEMORY, f"no GPU {uuid} visible to this sidecar "
                           f"({count} visible): check CUDA_VISIBLE_DEVICES on both sides")

    def caps(self, device: int) -> Caps:
        caps = self._caps.get(device)
        if caps is None:
            self._primary(device)
            dev = self._ok(self.d.cuDeviceGet(device), "cuDeviceGet")
            a = self.d.CUdevice_attribute

            def attr(name: str) -> bool:
                return bool(self._ok(self.d.cuDeviceGetAttribute(getattr(a, name), dev), name))

            caps = Caps(
                vmm=attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
                posix_fd=attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
                fabric=attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"),
                rdma=attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"),
            )
            if not (caps.vmm and caps.posix_fd):
                raise VmmUnavailable(f"GPU {device} has no VMM allocations with POSIX-fd handles")
            self._caps[device] = caps
        return caps

    def prop(self, device: int, fabric: bool, rdma: bool) -> Any:
        """The ``CUmemAllocationProp`` of a pool on ``device``."""
        d = self.d
        p = d.CUmemAllocationProp()
        p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = device
        types = int(d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        if fabric:
            types |= int(d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
        p.requestedHandleTypes = types
        p.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        return p

    def granularity(self, device: int) -> int:
        g = self._gran.get(device)
        if g is None:
            caps = self.caps(device)
            g = int(self._ok(self.d.cuMemGetAllocationGranularity(
                self.prop(device, False, caps.rdma),
                self.d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity"))
            self._gran[device] = g
        return g

    def free_memory(self, device: int) -> int:
        with self.context(device):
            free, _total = self._ok(self.d.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    # ------------------------------------------------------------------ the sidecar's side

    def create_exported(self, size: int, device: int) -> tuple[int, int]:
        """A new allocation of at least ``size`` bytes on ``device``; returns (its POSIX fd,
        its size). No handle or mapping is kept here: the fd is the allocation."""
        caps = self.caps(device)
        size = align_up(size, self.granularity(device))
        handle = None
        with self.context(device):
            fabric = caps.fabric and device not in self._no_fabric
            ret = self.d.cuMemCreate(size, self.prop(device, fabric, caps.rdma), 0)
            if fabric and ret[0] in (self.d.CUresult.CUDA_ERROR_NOT_PERMITTED,
                                     self.d.CUresult.CUDA_ERROR_NOT_SUPPORTED):
                # fabric handles need an IMEX channel: without one, POSIX fds only (from now on)
                self._no_fabric.add(device)
                log.info("GPU %d: no fabric handles here (%s); pools export POSIX fds only",
                         device, self._name(ret[0]))
                fabric = False
                ret = self.d.cuMemCreate(size, self.prop(device, False, caps.rdma), 0)
            handle = self._ok(ret, f"cuMemCreate({size} bytes on GPU {device})")
            try:
                fd = int(self._ok(self.d.cuMemExportToShareableHandle(
                    handle, self.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    "cuMemExportToShareableHandle"))
            except BaseException:
                self._quietly(self.d.cuMemRelease(handle), "cuMemRelease")
                raise
            try:
                self._ok(self.d.cuMemRelease(handle), "cuMemRelease")  # the fd is the allocation now
            except BaseException:
                os.close(fd)
                raise
        os.set_inheritable(fd, False)
        log.debug("GPU %d: pool of %d bytes, handles posix_fd%s, gpuDirectRDMACapable=%d", device, size,
                  "+fabric" if fabric else "", int(caps.rdma))
        return fd, size

    # ------------------------------------------------------------------ anyone's side

    def import_fd(self, fd: int, size: int, device: int) -> VmmMapping:
        """Map the first ``size`` bytes (rounded up to the granularity, as the driver wants
        every size) of the allocation behind ``fd``; the caller keeps ``fd``."""
        size = align_up(size, self.granularity(device))
        with self.context(device):
            handle = self._ok(self.d.cuMemImportFromShareableHandle(
                fd, self.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle (is the fd a VMM allocation?)")
            va = None
            mapped = False
            try:
                where = self._ok(self.d.cuMemGetAllocationPropertiesFromHandle(handle),
                                 "cuMemGetAllocationPropertiesFromHandle").location.id
                if int(where) != device:
                    raise RequestError(ErrorCode.INVALID_MEMORY, f"the allocation is on GPU {where}, "
                                       f"not GPU {device}")
                va = int(self._ok(self.d.cuMemAddressReserve(size, self.granularity(device), 0, 0),
                                  "cuMemAddressReserve"))
                self._ok(self.d.cuMemMap(va, size, 0, handle, 0), f"cuMemMap({size} bytes)")
                mapped = True
                access = self.d.CUmemAccessDesc()
                access.location.type = self.d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = device
                access.flags = self.d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                self._ok(self.d.cuMemSetAccess(va, size, [access], 1), "cuMemSetAccess")
            except BaseException:
                if mapped:
                    self._quietly(self.d.cuMemUnmap(va, size), "cuMemUnmap")
                if va is not None:
                    self._quietly(self.d.cuMemAddressFree(va, size), "cuMemAddressFree")
                self._quietly(self.d.cuMemRelease(handle), "cuMemRelease")
                raise
            self._quietly(self.d.cuMemRelease(handle), "cuMemRelease")  # the mapping holds it now
        return VmmMapping(self, va, size, device)

    def alloc_device(self, size: int, device: int) -> DeviceBuffer:
        """Plain device memory (``cuMemAlloc``): legacy-IPC capable, what UCX exports over
        cuda_ipc without IMEX, whatever torch's allocator is set to (``expandable_segments``
        and ``cudaMallocAsync`` give VMM or pool memory, which UCX then moves over tcp)."""
        with self.context(device):
            ptr = int(self._ok(self.d.cuMemAlloc(size), f"cuMemAlloc({size})"))
            a = self.d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
            try:
                legacy = bool(self._ok(self.d.cuPointerGetAttribute(a, ptr), "cuPointerGetAttribute"))
            except RequestError as e:
                legacy = False
                log.warning("%s", e)
        return DeviceBuffer(self, ptr, size, device, legacy)

    def free_device(self, ptr: int, device: int) -> None:
        with self.context(device):
            self._ok(self.d.cuCtxSynchronize(), "cuCtxSynchronize")  # no copy still running in it
            self._ok(self.d.cuMemFree(ptr), "cuMemFree")

    def unmap(self, va: int, size: int, device: int) -> None:
        with self.context(device):
            self._ok(self.d.cuCtxSynchronize(), "cuCtxSynchronize")  # no copy still running into it
            self._ok(self.d.cuMemUnmap(va, size), "cuMemUnmap")
            self._ok(self.d.cuMemAddressFree(va, size), "cuMemAddressFree")


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise VmmUnavailable("GPU pools need the cuda-bindings package (pip install kvxfer[gpu])") from e
    return driver


_shared: Vmm | None = None
_shared_lock = threading.Lock()


def shared() -> Vmm:
    """This process's ``Vmm`` (contexts are per process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Vmm()
        return _shared
