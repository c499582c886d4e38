"""The staging arena and its copies (#35; the plan is ``kvxfer.sidecar.staging``). Used on
the NIXL port's thread only, like the registrations whose memory it copies from and into.

The arena is host memory of this process, registered with the NIXL agent before the first
handshake (so every Welcome's metadata covers it) and touched once at start (a first write
into untouched pages is 25-30x slower). Slots in it are handed out on the loop
(``SlotBook``); only their addresses cross the thread line.

The copies themselves (host and torch) are ``kvxfer.sidecar.nixl_copies``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import RankInfo
from kvxfer.sidecar.nixl_copies import by_offset, copy_runs, gather, scatter
from kvxfer.sidecar.nixl_memory import Cleanup, Leg, LocalRank, PairLists, Registrations
from kvxfer.sidecar.nixl_reads import Read
from kvxfer.sidecar.nixl_types import TransferOptions
from kvxfer.sidecar.plan import LegPlan, ReadSpec, StagedRead
from kvxfer.sidecar.staging import arena_device, held_intervals, runs_inside

log = logging.getLogger("kvxfer.staging")

# The staged transfer's descriptors: a host slot is read in pieces of this size (UCX's worker
# threads copy several at once; one 16 MiB descriptor is copied by one), a VRAM slot in
# pieces of STAGED_VRAM_DESC_BYTES: cuda_ipc moves each as one device copy, and on the H200
# 512 descriptors of 2 MiB took 3.6 ms a GiB where one descriptor of 1 GiB took 0.74.
STAGED_DESC_BYTES = 2 << 20
STAGED_VRAM_DESC_BYTES = 64 << 20


ARENA_RETRY_S = 30.0  # a device whose arena could not be made (out of memory) is tried again after


class StagingArena:
    """One arena: host memory of this process (``device`` -1), or VRAM of a CUDA device that
    this process allocated itself (``_device_memory``), the memory UCX moves over cuda_ipc;
    copies into and out of it then run on the arena's own stream."""

    def __init__(self, agent: Any, size: int, device: int = -1) -> None:
        self._agent = agent
        self.device = device
        self.mem_type = "DRAM" if device < 0 else "VRAM"
        self.tensor: Any = None  # (torch copies: VRAM, or host memory under the test hook below)
        self.stream: Any = None
        self._buf: Any = None  # (VRAM this process allocated: kvxfer.vmm.DeviceBuffer)
        if device < 0:
            self._mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buf = np.frombuffer(self._mem, dtype=np.uint8)
            self.buf[::mmap.PAGESIZE] = 0  # touch every page now, not on the first read
            self.addr = self.buf.ctypes.data
            if os.environ.get("KVXFER_TEST_TORCH_COPIES") == "1":  # VRAM's copies, run on host memory
                import torch

                self.tensor = torch.from_numpy(self.buf)
                self._warm()
        else:
            self._buf, self.tensor = _device_memory(size, device)
        self.size = size
        try:
            if device >= 0:
                import torch

                self.stream = torch.cuda.Stream(device)
                self.addr = int(self.tensor.data_ptr())
                self._warm()
            self._reg = agent.register_memory([(self.addr, size, max(device, 0), "")], self.mem_type)
        except BaseException:  # (an arena that failed gives its VRAM back: DeviceBuffer has no finalizer)
            self._reg = None
            self.close()
            raise

    def close(self) -> None:
        if self._reg is not None:
            with contextlib.suppress(Exception):  # (the agent goes with the process)
                self._agent.deregister_memory(self._reg)
        torch_owned = self.device >= 0 and self._buf is None and self.tensor is not None
        self.tensor = None
        buf, self._buf = self._buf, None
        if buf is not None:
            with contextlib.suppress(Exception):
                buf.close()
        elif torch_owned:  # (torch's allocator would keep the arena cached from the engine)
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()

    def _warm(self) -> None:
        """Both copies once, into and out of the arena's first granule: CUDA loads their kernels lazily,
        which the first staged read would otherwise pay."""
        # (two tensors of their own: CUDA's index_select refuses an ``out`` in its input's memory)
        import torch

        with self.on_stream():
            src = torch.zeros(256, dtype=torch.uint8, device=self.tensor.device)
            run, mem = np.array([[src.data_ptr(), 256]], dtype=np.int64), [(src.data_ptr(), src)]
            copy_runs(self.tensor[:256], run, mem, into_slot=True)
            copy_runs(self.tensor[:256], run, mem, into_slot=False)
        self.sync()

    def check(self, addr: int, nbytes: int) -> None:
        if not (self.addr <= addr and addr + nbytes <= self.addr + self.size):
            raise RequestError(ErrorCode.INTERNAL, "staging slot outside the arena")

    def slot(self, addr: int, nbytes: int) -> Any:
        """A VRAM arena's bytes ``[addr, addr + nbytes)`` as a uint8 tensor (a view)."""
        self.check(addr, nbytes)
        return self.tensor[addr - self.addr:addr - self.addr + nbytes]

    def on_stream(self) -> Any:
        """The arena's device and stream current for the block, the thread's own after it
        (``torch.cuda.device`` restores the device without making a context on device 0)."""
        if self.stream is None:
            return contextlib.nullcontext()
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _device_memory(size: int, device: int) -> tuple[Any, Any]:
    """A VRAM arena's memory: ``cuMemAlloc``ed through ``kvxfer.vmm`` (legacy-IPC capable,
    whatever torch's allocator is set to), else torch's allocator, with a warning where
    ``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments``, ``cudaMallocAsync``) makes it memory
    UCX moves over tcp. (the buffer to close or None, a uint8 tensor over it)."""
    import torch

    from kvxfer import vmm

    try:
        buf = vmm.shared().alloc_device(size, device)
    except vmm.VmmUnavailable as e:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.lower().replace(" ", "") or "cudamallocasync" in conf.lower():
            log.warning("VRAM staging arena from torch's allocator (%s) under PYTORCH_CUDA_ALLOC_CONF=%s: "
                        "UCX cannot export that memory over cuda_ipc; install cuda-bindings "
                        "(kvxfer[cu13]) so the arena is cuMemAlloc'ed", e, conf)
        return None, torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    if not buf.legacy_ipc:
        log.warning("the VRAM staging arena on cuda:%d is not legacy-IPC capable: UCX moves it over tcp",
                    device)
    try:
        return buf, buf.tensor()
    except BaseException:
        buf.close()
        raise


class Arenas:
    """This sidecar's arenas by device (-1: host): the host one made with the agent, one per
    CUDA device at the first VRAM registration on it (``for_rank``, on the NIXL thread before
    that registration is answered: the metadata of every Welcome that offers the rank then
    covers its device's arena). ``spans()`` is what the loop is handed."""

    def __init__(self, agent: Any, host_bytes: int, vram_bytes: int) -> None:
        self._agent = agent
        self.vram_bytes = vram_bytes
        self.by_device: dict[int, StagingArena] = {}
        self._failed: dict[int, float] = {}  # device: when its arena could not be made
        self.missing: set[int] = set()  # devices with VRAM registered and no arena (yet)
        if host_bytes > 0:
            self.by_device[-1] = StagingArena(agent, host_bytes)

    def for_rank(self, info: RankInfo) -> dict[int, tuple[int, int]]:
        """The arena of a newly registered rank's device made if it is the first there; the spans."""
        dev = arena_device(info)
        if self.vram_bytes <= 0 or dev is None or dev < 0 or dev in self.by_device:
            return self.spans()
        if time.monotonic() - self._failed.get(dev, -ARENA_RETRY_S) < ARENA_RETRY_S:
            return self.spans()
        try:
            self.by_device[dev] = StagingArena(self._agent, self.vram_bytes, dev)
            self.missing.discard(dev)
            log.info("VRAM staging arena: %d MiB on cuda:%d", self.vram_bytes >> 20, dev)
        except Exception as e:  # (out of memory, most likely: its reads go directly, slowly)
            self._failed[dev] = time.monotonic()
            self.missing.add(dev)
            log.warning("no VRAM staging arena of %d MiB on cuda:%d (%s): its ranks' reads go directly, "
                        "over whatever lane UCX finds (tcp where it cannot export them); tried again at "
                        "a registration on it from %.0f s on", self.vram_bytes >> 20, dev, e, ARENA_RETRY_S)
        return self.spans()

    def get(self, device: int) -> StagingArena | None:
        return self.by_device.get(device)

    def spans(self) -> dict[int, tuple[int, int]]:
        return {d: (a.addr, a.size) for d, a in self.by_device.items()}

    def close(self) -> None:
        for arena in self.by_device.values():
            arena.close()


# ---------------------------------------------------------------------- copies


_warming: list[threading.Thread] = []


def warm_copies(arenas: Arenas | None) -> None:
    """The copies use torch (~1 s to import): import it in the background as soon as this
    sidecar has a host arena (at start: staging is off by default, so a sidecar that stages
    was asked to), never in a staged read. Imported at the first handshake instead, the
    first staged read after it waited for the import (0.9 s of a 1.35 s first read, measured
    with ``kvxfer demo`` on 2 cores)."""
    if arenas is not None and -1 in arenas.by_device and not _warming:
        _warming.append(threading.Thread(target=_import_torch, name="kvxfer-import", daemon=True))
        _warming[0].start()


def warm_thread() -> threading.Thread | None:
    """The background import ``warm_copies`` started, if it did (``kvxfer.serve`` freezes the
    heap once it ends: ``kvxfer.gc_heap``)."""
    return _warming[0] if _warming else None


def _import_torch() -> None:
    import torch

    # One thread per copy: torch's intra-op pool spins between ops, and on a host whose
    # cores are busy (its peer sidecar, engines) a copy then waits for a descheduled
    # helper (measured on 2 cores: 2 MiB gathers took 1.3-10 ms with 2 threads).
    torch.set_num_threads(1)


def _tensors(rank: LocalRank) -> list[tuple[int, Any]]:
    """A rank's memory as (base, uint8 tensor), sorted by base (host memory: its numpy view
    made a tensor, for the test hook ``KVXFER_TEST_TORCH_COPIES``)."""
    import torch

    out = []
    for m in rank.mappings:
        t = m.as_tensor()
        t = (t if isinstance(t, torch.Tensor) else torch.from_numpy(t))[:m.size]  # (a VMM one is
        # granularity-sized: its tail is no block's)
        if t.data_ptr() != m.addr or t.numel() != m.size or (t.is_cuda and t.device.index != m.device_id):
            raise RequestError(ErrorCode.INTERNAL, f"the tensor over the mapping at {m.addr:#x} is not it")
        out.append((m.addr, t))
    return sorted(out, key=lambda bt: bt[0])


def scatter_vram(arena: StagingArena, st: StagedRead, rank: LocalRank) -> None:
    """The decode's last step of a staged VRAM read: the landed slot into the blocks, on the
    arena's stream, done before the read is reported landed."""
    pieces = by_offset(st.scatter)
    total = int(pieces[:, 2].sum())
    slot = arena.slot(st.local_addr + int(pieces[0, 1]), total)
    with arena.on_stream():
        copy_runs(slot, pieces[:, [0, 2]], _tensors(rank), into_slot=False)
    arena.sync()


# ---------------------------------------------------------------------- the two sides


@dataclass
class GatherJob:
    """A prefill's gather, checked: ``copy`` moves every rank's runs into the slot at ``dst``."""

    arena: StagingArena
    dst: int
    checked: list[tuple[LocalRank, np.ndarray]]
    keys: list[Any]
    token: str = ""  # set while it runs off the NIXL thread (``Gathers``)

    def copy(self) -> None:
        dst = self.dst
        if self.arena.tensor is not None:  # (VRAM)
            with self.arena.on_stream():
                for rank, runs in self.checked:
                    n = int(runs[:, 1].sum())
                    copy_runs(self.arena.slot(dst, n), runs, _tensors(rank), into_slot=True)
                    dst += n
            self.arena.sync()  # (copied before the answer says so)
            return
        for _, runs in self.checked:
            dst += gather(dst, runs)


Runs = list[tuple[Any, np.ndarray]]


def plan_gather(local: dict[Any, LocalRank], arenas: Arenas | None, device: int, ranks: Runs,
                blocks: list[int], offset: int, nbytes: int) -> GatherJob:
    """The prefill's half, checked (on the thread that owns the registrations): every rank's
    runs lie inside ``blocks`` (the held ones) of that rank's regions, and fill the slot at
    ``offset`` of ``device``'s arena, rank after rank."""
    arena = arenas.get(device) if arenas is not None else None
    if arena is None:
        raise RequestError(ErrorCode.INCOMPATIBLE, "this sidecar has no staging arena")
    total = sum(int(runs[:, 1].sum()) for _, runs in ranks)
    if total != nbytes:
        raise RequestError(ErrorCode.MALFORMED, f"runs of {total} bytes for a slot of {nbytes}")
    dst = arena.addr + offset
    arena.check(dst, nbytes)
    checked = []
    for key, runs in ranks:
        rank = local.get(key)
        if rank is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank {key} is not registered")
        if arena_device(rank.info) != arena.device:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"rank {key}'s memory is not on the arena's device")
        regions = np.array([(r.addr, r.block_len, r.block_stride) for r in rank.info.regions], dtype=np.int64)
        starts, ends = held_intervals(regions, np.asarray(blocks, dtype=np.int64), rank.num_blocks)
        bad = runs_inside(runs, starts, ends)
        if bad >= 0:
            raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE,
                               f"run {bad} of rank {key} is outside the blocks held for this request")
        checked.append((rank, runs))
    return GatherJob(arena, dst, checked, [key for key, _ in ranks])


class Gathers:
    """Host gathers off the NIXL thread (#35). In UCX peer mode a READ completes only once its
    target makes progress, so a gather on the prefill's NIXL thread (5-13 ms for 16 MiB of
    head slices) held every READ from this sidecar until it ended: a decode's read of the
    request staged before waited behind the gather of the next. A host gather is checked on
    the NIXL thread and copied on a thread of its own (the copies release the GIL); the ranks
    it reads stay pinned until it ended (``pinned``: an unregister releases their memory only
    then). VRAM gathers stay on the NIXL thread (their own CUDA stream; not measured apart)."""

    def __init__(self, cleanup: Cleanup, submit: Callable[[Callable[[], None]], object]) -> None:
        self._cleanup = cleanup
        self._submit = submit  # (queues a command to the NIXL thread)
        self._pinned: dict[Any, set[str]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._n = 0

    def start(self, job: GatherJob) -> concurrent.futures.Future[None] | None:
        """On the NIXL thread: a VRAM job copied here (None), a host one started on the copier
        (one worker: a slot freed under a copy abandoned by its caller is filled again only
        after it)."""
        if job.arena.tensor is not None:
            job.copy()
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer-gather")
        self._n += 1
        job.token = f"gather#{self._n}"
        running = self._pool.submit(job.copy)
        # pinned only once submitted (it raises: nothing to unpin); unpinned on the NIXL thread
        # once the copy ended, or was cancelled before it started (its caller gave up)
        for key in job.keys:
            self._pinned.setdefault(key, set()).add(job.token)
        running.add_done_callback(lambda _: self._submit(lambda: self._done(job)))
        return running

    def pinned(self, key: Any) -> set[str]:
        return set(self._pinned.get(key, ()))

    def _done(self, job: GatherJob) -> None:
        for key in job.keys:
            left = self._pinned.get(key, set())
            left.discard(job.token)
            if not left:
                self._pinned.pop(key, None)
        self._cleanup.settled(job.token)

    def close(self) -> None:
        """At shutdown, on the NIXL thread: wait for a copy still running, then let its ranks go."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for token in {t for tokens in self._pinned.values() for t in tokens}:
            self._cleanup.settled(token)
        self._pinned.clear()


def staged_leg(st: StagedRead) -> Leg:
    """The one leg of a staged read: slot to slot in descriptors of STAGED_DESC_BYTES (VRAM:
    STAGED_VRAM_DESC_BYTES)."""
    size = STAGED_VRAM_DESC_BYTES if st.mem_type == "VRAM" else STAGED_DESC_BYTES
    starts = np.arange(0, st.nbytes, size, dtype=np.int64)
    lens = np.minimum(size, st.nbytes - starts)
    dev = np.ones_like(starts)
    local = np.stack([st.local_addr + starts, lens, dev * st.local_device], axis=1)
    remote = np.stack([st.remote_addr + starts, lens, dev * st.remote_device], axis=1)
    empty = np.empty(0, np.int32)
    plan = LegPlan(empty, empty, st.nbytes, runs=(local, remote), chunk=len(starts))
    return Leg(PairLists(None, None, None, st.mem_type, st.mem_type), plan)  # type: ignore[arg-type]


def new_read(regs: Registrations, arenas: Arenas | None, spec: ReadSpec, options: TransferOptions,
             marks: list[tuple[str, int]] | None, corrupt: bool) -> Read:
    """A read as the NIXL thread posts it: its legs from the prepared lists (direct), or
    the one slot-to-slot leg and the scatter that follows its landing (staged). ``corrupt``:
    the test hook flips the first byte it writes once it landed (KVXFER_TEST_CORRUPT_READS)."""
    st = spec.staged
    after: Callable[[], None] | None = None
    if st is None:
        legs, nbytes = regs.legs(spec, options.chunk_bytes, options.merge_runs)
    else:
        arena = arenas.get(st.local_device if st.mem_type == "VRAM" else -1) if arenas is not None else None
        if arena is None:
            raise RequestError(ErrorCode.INCOMPATIBLE, "a staged read, and no staging arena here")
        arena.check(st.local_addr, st.nbytes)
        legs, nbytes = [staged_leg(st)], st.nbytes + st.before[0]
        after = _after_landing(arena, st, regs.local.get(spec.local_rank))
    return Read(req_id=spec.req_id, peer=spec.peer, local_rank=spec.local_rank, legs=legs, nbytes=nbytes,
                deadline=spec.deadline, started_notice=spec.started_notice,
                corrupt_at=regs.first_byte(spec) if corrupt else 0, trace=marks,
                trust_until=st.trust_until if st else 0.0, proof_addr=0 if st else spec.proof_addr,
                after_landing=after, descriptors_before=st.before[1] if st else 0,
                started=time.monotonic() - (st.before[2] if st else 0.0))


def _after_landing(arena: StagingArena, st: StagedRead, rank: LocalRank | None) -> Callable[[], None]:
    """The scatter of a staged read's landed slot into its blocks."""
    if arena.tensor is None:  # (host memory)
        return lambda: scatter(st.local_addr, st.scatter)
    if rank is None:
        raise RequestError(ErrorCode.NOT_REGISTERED, "local rank not registered")
    return lambda: scatter_vram(arena, st, rank)
