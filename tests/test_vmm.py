"""The GPU half of the memory channel (``kvxfer.vmm``) without a GPU: our use of the CUDA VMM
API against a fake driver (``tests/fake_cuda.py``: host memfds stand in for device memory),
and the names, enums and structs we use against the real ``cuda.bindings`` where it is
installed. None of this shows that the GPU path works; ``tests/test_gpu.py`` runs it on a
GPU. What it does show: sizes are granularity-aligned, the allocation is exportable as a
POSIX fd (fabric where allowed, falling back without), GPUDirect-RDMA-capable where the
device says so, no handle or mapping leaks on any path, and a GPU pool's fd travels over
the memory channel so that the engine and the sidecar map the same memory.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

from kvxfer import vmm
from kvxfer.errors import ErrorCode, KvxferError, RequestError
from kvxfer.memchannel import memfd
from kvxfer.pool import PoolClient
from kvxfer.protocol import PoolMemory
from kvxfer.sidecar.mapping import map_memory
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.vmm import Vmm, VmmUnavailable, align_up
from tests.fake_cuda import CUdevice_attribute as Attr
from tests.fake_cuda import FakeDriver

MiB = 1 << 20
G = 2 * MiB
NONE = {"handles": 0, "reserved": 0, "mapped": 0, "contexts_left_current": 0}


def test_an_allocation_is_aligned_exported_as_an_fd_and_keeps_no_handle() -> None:
    fake = FakeDriver(attrs={int(Attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED): 0})
    v = Vmm(fake)
    fd, size = v.create_exported(5 * MiB + 1, 0)
    try:
        assert size == align_up(5 * MiB + 1, G) == 6 * MiB
        assert not os.get_inheritable(fd)  # not leaked into children the sidecar starts
        prop = fake.created[0]
        assert prop.location.id == 0
        fd_type = fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        assert prop.requestedHandleTypes == fd_type
        assert prop.allocFlags.gpuDirectRDMACapable == 1  # the fake device supports it
        assert fake.leaks() == NONE  # the fd is the allocation
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)


def test_fabric_handles_are_asked_for_where_supported_and_dropped_when_not_permitted() -> None:
    allowed = FakeDriver(fabric_permitted=True)
    fd, _ = Vmm(allowed).create_exported(G, 0)
    os.close(fd)
    both = int(allowed.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) | int(
        allowed.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    assert allowed.created[0].requestedHandleTypes == both

    refused = FakeDriver(fabric_permitted=False)  # no IMEX channel: cuMemCreate says not permitted
    v = Vmm(refused)
    for _ in range(2):
        fd, _ = v.create_exported(G, 0)
        os.close(fd)
    assert [n for n, _ in refused.calls].count("cuMemCreate") == 3  # asked for fabric once only
    assert refused.created[0].requestedHandleTypes == int(
        refused.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)


def test_no_rdma_flag_where_the_device_has_no_gpudirect_rdma_on_vmm() -> None:
    fake = FakeDriver(attrs={int(Attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED): 0})
    fd, _ = Vmm(fake).create_exported(G, 0)
    os.close(fd)
    assert fake.created[0].allocFlags.gpuDirectRDMACapable == 0


def test_two_importers_of_one_fd_see_the_same_memory_and_unmapping_leaks_nothing() -> None:
    sidecar, engine = FakeDriver(), FakeDriver()  # two "processes"
    fd, size = Vmm(sidecar).create_exported(3 * MiB, 0)
    try:
        mine = Vmm(engine).import_fd(fd, 3 * MiB, 0)
        theirs = Vmm(sidecar).import_fd(fd, size, 0)
        assert mine.size == theirs.size == 4 * MiB  # mapped in whole granules
        assert engine.access[mine.va] == (0, int(engine.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
        assert engine.handles == {}  # the import's handle is released: the mapping holds the memory
        engine.view(mine.va)[100:108] = b"kvxfer!!"
        assert sidecar.view(theirs.va)[100:108] == b"kvxfer!!"
        mine.close()
        theirs.close()
        mine.close()  # twice is harmless
        assert engine.leaks() == sidecar.leaks() == NONE
    finally:
        os.close(fd)


def test_a_failed_import_releases_what_it_took() -> None:
    sidecar, engine = FakeDriver(), FakeDriver()
    fd, _ = Vmm(sidecar).create_exported(G, 0)
    try:
        with pytest.raises(RequestError) as ei:
            Vmm(engine).import_fd(fd, 2 * G, 0)  # larger than the allocation: cuMemMap fails
        assert ei.value.code == ErrorCode.MEMORY_MAP_FAILED
        assert "cuMemMap" in ei.value.reason
        assert "CUDA_ERROR_INVALID_VALUE" in ei.value.reason
        assert engine.leaks() == NONE
    finally:
        os.close(fd)
    host = memfd(G)  # not a VMM allocation at all
    try:
        with pytest.raises(RequestError, match="cuMemImportFromShareableHandle"):
            Vmm(engine).import_fd(host, G, 0)
    finally:
        os.close(host)


def test_no_driver_or_no_vmm_is_a_typed_unsupported_error() -> None:
    with pytest.raises(VmmUnavailable) as ei:
        Vmm(FakeDriver(no_library=True)).create_exported(G, 0)
    assert ei.value.code == ErrorCode.UNSUPPORTED
    assert "no CUDA driver" in ei.value.reason
    no_vmm = FakeDriver(attrs={int(Attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED): 0})
    with pytest.raises(VmmUnavailable, match="no VMM"):
        Vmm(no_vmm).create_exported(G, 0)


@pytest.fixture
def gpu_channel(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A memory channel whose sidecar and engine each have their own fake driver."""
    sidecar, engine = FakeDriver(free=64 * MiB), FakeDriver()
    monkeypatch.setattr(vmm, "_shared", Vmm(engine))  # what the engine's Pool.map_gpu() uses
    server = PoolServer(str(tmp_path / "e.sock.mem"), vmm=Vmm(sidecar))
    server.start()
    client = PoolClient(server.path, timeout_s=5)
    try:
        yield server, client, sidecar, engine
    finally:
        client.close()
        server.close()


def test_a_gpu_pool_crosses_the_memory_channel_and_both_sides_map_the_same_memory(gpu_channel) -> None:  # type: ignore[no-untyped-def]
    server, client, sidecar, engine = gpu_channel
    pool = client.create(3 * MiB, label="kv tp0", device=0)
    assert (pool.size, pool.device) == (4 * MiB, 0)  # granted in whole granules
    t = pool.map_gpu()
    engine.view(t.va)[:4] = b"\x01\x02\x03\x04"
    # the sidecar's registration maps the pool by id (as map_memory does on the NIXL thread)
    m = map_memory(PoolMemory(pool=pool.id, size=3 * MiB), server)
    assert (m.mem_type, m.device_id, m.size) == ("VRAM", 0, 3 * MiB)
    assert sidecar.view(m.addr)[:4] == b"\x01\x02\x03\x04"
    assert server.stats() == (1, 4 * MiB)
    with pytest.raises(ValueError, match="map_gpu"):
        pool.map()  # a GPU pool has no host mapping
    m.close()
    assert sidecar.leaks() == NONE


def test_a_restarted_sidecar_takes_gpu_pools_back_and_refuses_what_is_not_one(gpu_channel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, client, sidecar, _ = gpu_channel
    pool = client.create(G, device=0)
    server.close()  # the sidecar is gone; the engine keeps its fds
    again = PoolServer(server.path, vmm=Vmm(sidecar))
    again.start()
    try:
        assert client.readopt() == 1
        assert again.stats() == (1, G)
        fd, size, device = again.dup(pool.id)
        os.close(fd)
        assert (size, device) == (G, 0)
        # a host memfd handed back as a GPU pool is refused (it does not import)
        liar = PoolClient(again.path, timeout_s=5)
        fake_pool = type(pool)("f" * 32, G, memfd(G), "", 0)
        liar.pools[fake_pool.id] = fake_pool
        try:
            with pytest.raises(KvxferError, match="invalid_memory"):
                liar.readopt()
        finally:
            liar.close()
    finally:
        again.close()


def test_gpu_pools_are_refused_past_free_vram_and_where_there_is_no_driver(gpu_channel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, client, _, _ = gpu_channel
    with pytest.raises(KvxferError, match=r"out_of_memory.*GPU 0 has free"):
        client.create(1 << 30, device=0)  # the fake device has 64 MiB free
    nodrv = PoolServer(str(tmp_path / "n.sock.mem"), vmm=Vmm(FakeDriver(no_library=True)))
    nodrv.start()
    c = PoolClient(nodrv.path, timeout_s=5)
    try:
        with pytest.raises(KvxferError, match="unsupported"):
            c.create(G, device=0)
        assert c.create(G).device == -1  # host pools still work
    finally:
        c.close()
        nodrv.close()


def test_what_we_call_exists_in_cuda_bindings_with_the_same_arity() -> None:
    """Hold every name, enum and struct field the fake saw against the real module."""
    driver = pytest.importorskip("cuda.bindings.driver")
    fake = FakeDriver(fabric_permitted=True)
    v = Vmm(fake)
    fd, size = v.create_exported(G, 0)
    v.import_fd(fd, size, 0).close()
    v.free_memory(0)
    v.alloc_device(G, 0).close()
    os.close(fd)
    for name, nargs in set(fake.calls):
        real = getattr(driver, name)
        sig = (real.__doc__ or "").splitlines()[0]
        params = re.match(rf"{name}\((.*)\)", sig)
        assert params is not None, sig
        count = len([p for p in params.group(1).split(",") if p.strip()])
        assert count == nargs, f"{name}: we pass {nargs} arguments, cuda.bindings takes {sig}"
    # the enums and struct fields, built with the real module (no driver needed for that)
    real = Vmm(driver)
    p = real.prop(0, fabric=True, rdma=True)
    assert p.allocFlags.gpuDirectRDMACapable == 1
    assert p.location.type == driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    for attr in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"):
        assert hasattr(driver.CUdevice_attribute, attr)
    a = driver.CUmemAccessDesc()
    a.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    assert inspect.isclass(driver.CUmemAllocationGranularity_flags)
    assert driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED


def test_the_sidecar_finds_the_engines_gpu_by_uuid_and_checks_where_an_allocation_lives() -> None:
    """CUDA_VISIBLE_DEVICES may differ: the engine's GPU 0 can be the sidecar's GPU 1."""
    fake = FakeDriver()
    v = Vmm(fake)
    assert v.ordinal_of("GPU-" + fake.uuids[1].hex()) == 1
    u = fake.uuids[0].hex()
    assert v.ordinal_of(f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}") == 0  # torch's form
    with pytest.raises(RequestError, match="CUDA_VISIBLE_DEVICES"):
        v.ordinal_of("GPU-" + "ff" * 16)
    fd, size = v.create_exported(G, 1)
    try:
        with pytest.raises(RequestError, match="on GPU 1, not GPU 0") as ei:
            v.import_fd(fd, size, 0)
        assert ei.value.code == ErrorCode.INVALID_MEMORY
        v.import_fd(fd, size, 1).close()
    finally:
        os.close(fd)
    assert fake.leaks() == NONE


def test_unmapping_waits_for_the_device_and_restores_the_callers_context() -> None:
    fake = FakeDriver()
    fake.ctx_stack.append(4242)  # torch's context, current on this thread
    v = Vmm(fake)
    fd, size = v.create_exported(G, 0)
    m = v.import_fd(fd, size, 0)
    assert fake.ctx_stack == [4242]
    m.close()
    os.close(fd)
    assert fake.synced == 1  # cuCtxSynchronize before cuMemUnmap
    names = [n for n, _ in fake.calls]
    assert names.index("cuCtxSynchronize") < names.index("cuMemUnmap")
    assert fake.ctx_stack == [4242]  # popped back, never left ours current


def test_out_of_device_memory_is_out_of_memory() -> None:
    fake = FakeDriver(free=G, fabric_permitted=True)
    with pytest.raises(RequestError) as ei:
        Vmm(fake).create_exported(4 * G, 0)
    assert ei.value.code == ErrorCode.OUT_OF_MEMORY
    assert [n for n, _ in fake.calls].count("cuMemCreate") == 1  # not retried without fabric


def test_a_gpu_pool_is_created_on_the_gpu_the_uuid_names(gpu_channel) -> None:  # type: ignore[no-untyped-def]
    server, client, sidecar, _ = gpu_channel
    pool = client.create(G, device=0, device_uuid="GPU-" + sidecar.uuids[1].hex())
    assert pool.device == 0  # the engine's ordinal, as it asked
    _, _, device = server.dup(pool.id)
    assert device == 1  # the sidecar's ordinal of the same GPU
    assert sidecar.created[-1].location.id == 1


def test_a_staging_arena_is_plain_device_memory_freed_after_its_copies() -> None:
    """VRAM staging arenas (``kvxfer.sidecar.nixl_staging``) are ``cuMemAlloc``ed, in the
    device's primary context (pushed for the call, popped after), legacy-IPC capable (the
    one kind UCX exports over cuda_ipc without IMEX), and freed after the device synchronized."""
    fake = FakeDriver()
    v = Vmm(fake)
    buf = v.alloc_device(3 * G, 1)
    assert buf.legacy_ipc
    assert fake.allocs == {buf.ptr: 3 * G}
    assert buf.device == 1
    assert fake.ctx_stack == []  # (popped again)
    synced = fake.synced
    buf.close()
    buf.close()  # (once)
    assert fake.allocs == {}
    assert fake.synced == synced + 1
    with pytest.raises(RequestError, match="cuMemAlloc"):
        v.alloc_device(fake.free + 1, 0)
