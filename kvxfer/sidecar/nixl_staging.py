"""The staging arena and its copies (#35; the plan is ``kvxfer.sidecar.staging``). Used on
the NIXL port's thread only, like the registrations whose memory it copies from and into.

The arena is host memory of this process, registered with the NIXL agent before the first
handshake (so every Welcome's metadata covers it) and touched once at start (a first write
into untouched pages is 25-30x slower). Slots in it are handed out on the loop
(``SlotBook``); only their addresses cross the thread line.

The copies move runs between raw addresses of this process. The runs are cut into granules
of one size (the greatest common divisor of their lengths) and copied all at once through
an overlapping "window" view (one row per byte offset, indexed by each granule's start):
``torch.index_select`` gathers them into the contiguous slot (4-14 GiB/s on one core here
for 256 B-64 KiB granules), a numpy fancy assignment scatters the slot into them (3-17
GiB/s); a few large runs are plain ``memmove``s. Both release the GIL. A scatter whose
granules all start a whole number of granules from the first (head slices, blocks: the
usual case) goes through a view of back-to-back rows instead, one void item per granule, by
``np.put``: 16 MiB of 256 B head slices in 3.0 ms where the window took 5.6-6.6 (memcpy of
the same bytes 2.5 ms; the gather's window is as fast as such a view here).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import time
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.sidecar.nixl_memory import Leg, LocalRank, PairLists, Registrations
from kvxfer.sidecar.nixl_reads import Read
from kvxfer.sidecar.nixl_types import TransferOptions
from kvxfer.sidecar.plan import LegPlan, ReadSpec, StagedRead
from kvxfer.sidecar.staging import held_intervals, runs_inside

# Runs are copied one by one (memmove) when there are fewer than FEW_RUNS, when they average
# LONG_RUN or more, or when they share no granule of MIN_GRANULE bytes; else all at once,
# cut into granules of their lengths' greatest common divisor, through window views.
FEW_RUNS = 16
LONG_RUN = 256 << 10
MIN_GRANULE = 64
# The staged transfer's descriptors: a slot is read in pieces of this size (UCX's worker
# threads copy several at once; one 16 MiB descriptor is copied by one).
STAGED_DESC_BYTES = 2 << 20


class StagingArena:
    def __init__(self, agent: Any, size: int) -> None:
        self._agent = agent
        self._mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self._mem, dtype=np.uint8)
        self.buf[::mmap.PAGESIZE] = 0  # touch every page now, not on the first read
        self.addr = self.buf.ctypes.data
        self.size = size
        self._reg = agent.register_memory([(self.addr, size, 0, "")], "DRAM")

    def close(self) -> None:
        with contextlib.suppress(Exception):  # (the agent goes with the process)
            self._agent.deregister_memory(self._reg)

    def check(self, addr: int, nbytes: int) -> None:
        if not (self.addr <= addr and addr + nbytes <= self.addr + self.size):
            raise RequestError(ErrorCode.INTERNAL, "staging slot outside the arena")


# ---------------------------------------------------------------------- copies


_warming: list[threading.Thread] = []


def warm_copies(arena: StagingArena | None) -> None:
    """The copies use torch (~1 s to import): import it in the background once a peer is
    known (its first staged read is near), not in that read, nor in every sidecar started."""
    if arena is not None and not _warming:
        _warming.append(threading.Thread(target=_import_torch, name="kvxfer-import", daemon=True))
        _warming[0].start()


def _import_torch() -> None:
    import torch

    # One thread per copy: torch's intra-op pool spins between ops, and on a host whose
    # cores are busy (its peer sidecar, engines) a copy then waits for a descheduled
    # helper (measured on 2 cores: 2 MiB gathers took 1.3-10 ms with 2 threads).
    torch.set_num_threads(1)


def _view(lo: int, span: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(lo))


def _windows(addrs: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A (rows, length) view whose row i starts at byte i of the span the runs cover, and
    each run's row. Building it touches no memory; only the indexed rows are read."""
    lo = int(addrs.min())
    span = int(addrs.max()) - lo + length
    base = _view(lo, span)
    win = np.lib.stride_tricks.as_strided(base, shape=(span - length + 1, length), strides=(1, 1))
    return win, addrs - lo


def _rows(addrs: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A (rows, length) view of the span the runs cover, rows back to back, and each run's
    row, when every run starts a whole number of rows from the first (the usual case: head
    slices and blocks at multiples of their size); None otherwise (see ``_windows``). A
    scatter into such rows by ``np.put`` runs at memcpy speed, ~2x the window's."""
    lo = int(addrs.min())
    rel = addrs - lo
    if (rel % length).any():
        return None
    n = int(rel.max()) // length + 1
    return _view(lo, n * length).reshape(n, length), rel // length


def _granules(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Runs cut into granules of one size (the greatest common divisor of their lengths):
    each granule's start, in order, and the size."""
    g = int(np.gcd.reduce(lengths))
    if g > 0 and int(lengths.min()) == int(lengths.max()):  # (runs of one size: each is one granule)
        return starts, g
    counts = lengths // g
    first = np.cumsum(counts) - counts
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    return np.repeat(starts, counts) + k * g, g


def gather(dst: int, runs: np.ndarray) -> int:
    """Copy ``runs`` ([addr, len] rows) one after the other to ``dst``; the bytes copied."""
    import torch

    total = int(runs[:, 1].sum())
    if total == 0:  # (empty runs only: nothing to copy, no granule to cut them into)
        return 0
    if len(runs) < FEW_RUNS or total // len(runs) >= LONG_RUN:
        at = dst
        for addr, n in runs.tolist():
            ctypes.memmove(at, addr, n)
            at += n
        return total
    starts, g = _granules(runs[:, 0], runs[:, 1])
    if g < MIN_GRANULE:  # (odd sizes: one copy per run)
        return gather_each(dst, runs)
    win, rows = _windows(starts, g)
    out = _view(dst, total).reshape(-1, g)
    torch.index_select(torch.from_numpy(win), 0, torch.from_numpy(rows), out=torch.from_numpy(out))
    return total


def gather_each(dst: int, runs: np.ndarray) -> int:
    at = dst
    for addr, n in runs.tolist():
        ctypes.memmove(at, addr, n)
        at += n
    return at - dst


def scatter(src: int, pieces: np.ndarray) -> None:
    """Copy each piece ([dst addr, offset at ``src``, len] rows) from ``src + offset``; the
    pieces tile ``[src, src + their total)`` in order of offset."""
    if len(pieces) > 1 and (pieces[1:, 1] < pieces[:-1, 1]).any():  # (mostly in order already)
        pieces = pieces[np.argsort(pieces[:, 1], kind="stable")]
    total = int(pieces[:, 2].sum())
    g = int(np.gcd.reduce(pieces[:, 2])) if len(pieces) else 0
    if len(pieces) < FEW_RUNS or total // len(pieces) >= LONG_RUN or g < MIN_GRANULE:
        for addr, off, n in pieces.tolist():
            ctypes.memmove(addr, src + off, n)
        return
    starts, g = _granules(pieces[:, 0], pieces[:, 2])
    packed = _view(src + int(pieces[0, 1]), total).reshape(-1, g)
    aligned = _rows(starts, g)
    if aligned is not None:  # rows of one void item each: np.put copies them at memcpy speed
        void = np.dtype(("V", g))
        np.put(aligned[0].view(void)[:, 0], aligned[1], packed.view(void)[:, 0])  # (views, never copies)
        return
    win, rows = _windows(starts, g)
    win[rows] = packed


# ---------------------------------------------------------------------- the two sides


def gather_ranks(local: dict[Any, LocalRank], arena: StagingArena | None, ranks: list[tuple[Any, np.ndarray]],
                 blocks: list[int], offset: int, nbytes: int) -> None:
    """The prefill's half: every rank's runs, checked to lie inside ``blocks`` (the held
    ones) of that rank's regions, copied into the slot at ``offset`` rank after rank."""
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
        if rank.info.mem_type != "DRAM":
            raise RequestError(ErrorCode.INCOMPATIBLE, "staging copies host memory only")
        regions = np.array([(r.addr, r.block_len, r.block_stride) for r in rank.info.regions], dtype=np.int64)
        starts, ends = held_intervals(regions, np.asarray(blocks, dtype=np.int64), rank.num_blocks)
        bad = runs_inside(runs, starts, ends)
        if bad >= 0:
            raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE,
                               f"run {bad} of rank {key} is outside the blocks held for this request")
        checked.append(runs)
    for runs in checked:
        dst += gather(dst, runs)


def staged_leg(st: StagedRead, mem_type: str = "DRAM") -> Leg:
    """The one leg of a staged read: slot to slot in descriptors of STAGED_DESC_BYTES."""
    starts = np.arange(0, st.nbytes, STAGED_DESC_BYTES, dtype=np.int64)
    lens = np.minimum(STAGED_DESC_BYTES, st.nbytes - starts)
    zero = np.zeros_like(starts)
    local = np.stack([st.local_addr + starts, lens, zero], axis=1)
    remote = np.stack([st.remote_addr + starts, lens, zero], axis=1)
    empty = np.empty(0, np.int32)
    plan = LegPlan(empty, empty, st.nbytes, runs=(local, remote), chunk=len(starts))
    return Leg(PairLists(None, None, None, mem_type, mem_type), plan)  # type: ignore[arg-type]


def new_read(regs: Registrations, arena: StagingArena | None, spec: ReadSpec, options: TransferOptions,
             marks: list[tuple[str, int]] | None, corrupt: bool) -> Read:
    """A read as the NIXL thread posts it: its legs from the prepared lists (direct), or
    the one slot-to-slot leg and the scatter that follows its landing (staged). ``corrupt``:
    the test hook flips the first byte it writes once it landed (KVXFER_TEST_CORRUPT_READS)."""
    st = spec.staged
    if st is None:
        legs, nbytes = regs.legs(spec, options.chunk_bytes, options.merge_runs)
    else:
        if arena is None:
            raise RequestError(ErrorCode.INCOMPATIBLE, "a staged read, and no staging arena here")
        arena.check(st.local_addr, st.nbytes)
        legs, nbytes = [staged_leg(st)], st.nbytes
    return Read(req_id=spec.req_id, peer=spec.peer, local_rank=spec.local_rank, legs=legs, nbytes=nbytes,
                deadline=time.monotonic() + spec.deadline_s, started_notice=spec.started_notice,
                corrupt_at=regs.first_byte(spec) if corrupt else 0, trace=marks,
                trust_until=st.trust_until if st else 0.0, proof_addr=0 if st else spec.proof_addr,
                after_landing=(lambda: scatter(st.local_addr, st.scatter)) if st else None)
