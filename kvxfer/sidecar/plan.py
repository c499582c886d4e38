"""Descriptor planning: which bytes a read moves, as NIXL descriptor rows and indices.

Pure: numpy and the topology's plans in, arrays out; no NIXL, no threads. The NIXL port
prepares descriptor lists from ``PairRows`` and posts the ``LegPlan``s this module computes.

Vocabulary. A *row* is one run of bytes inside every block of a region (a plan's segment,
or several merged where they touch on both sides), with the geometry ``[addr, len, stride,
device]``; a *descriptor index* is ``row * num_blocks + block`` into a prepared list. A
*leg* is the part of a read that comes from one remote rank.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvxfer.protocol import RemoteRegion
from kvxfer.topology import BlockPairing, RankPlan

# Merging consecutive blocks costs an un-prepared transfer (NIXL's initialize_xfer: ~50 us
# more than make_prepped_xfer, measured here) and saves ~2 us of transfer per descriptor
# it removes (32 KiB descriptors: 4.2 GB/s, 256 KiB and up: 5.4-5.6 GB/s, one transfer on
# this CPU); below this many descriptors saved, the prepared lists are used as they are.
MERGE_MIN_SAVED = 32


@dataclass(frozen=True)
class StagedRead:
    """What makes a read staged: its slots on both sides and how to scatter the local one."""

    local_addr: int  # the slot in this sidecar's arena
    remote_addr: int  # the slot in the peer's arena
    nbytes: int
    scatter: np.ndarray  # int64 (m, 3): [local addr, offset in the slot, len]
    trust_until: float  # monotonic: a landing seen later is not trusted (the peer may reuse its slot)
    mem_type: str = "DRAM"  # both slots' ("VRAM": arenas of the two ranks' CUDA devices)
    local_device: int = 0
    remote_device: int = 0
    # the last window of a read in windows: the others' bytes and descriptors, and the seconds
    # since the first was posted (its Done reports the whole read)
    before: tuple[int, int, float] = (0, 0, 0.0)


@dataclass(frozen=True)
class ReadSpec:
    """One read, as the receiver asks the NIXL port for it (all blocks of one local rank,
    from one peer)."""

    req_id: str  # the receive's key (one per request and local rank)
    peer: str  # the remote NIXL agent
    local_rank: object  # the registry's RankKey
    local_blocks: list[int]
    remote_blocks: list[int]
    plans: list[RankPlan]
    pairing: BlockPairing
    deadline: float  # time.monotonic() by which it lands or fails: absolute, so that a read
    # queued behind the NIXL thread (a long copy, a registration, a frozen process) keeps its
    # receive's deadline instead of starting one anew when it is taken up (found by a review)
    started_notice: bytes = b""  # sent to the peer once the chunks the cap allows are posted
    remote_engine: str = ""
    state_blocks: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    trace: bool = False  # record the NIXL side's hops (Done.trace)
    staged: StagedRead | None = None  # read the peer's staging slot instead (kvxfer.sidecar.staging)
    proof_addr: int = 0  # the peer's lease word to read once the data landed (0: none; lease_words)
    alone: bool = False  # nothing else waits for the caller's loop: a larger read may be posted there

    @property
    def num_blocks(self) -> int:
        """Local blocks it writes (attention and state)."""
        return len(self.local_blocks) + len(self.state_blocks[0])


@dataclass(frozen=True)
class PairRows:
    """The rows one (local rank, remote rank) plan reads: ``rows[q]`` the row ids that
    sub-position q reads; ``local``/``remote`` each row's geometry on its side."""

    rows: list[np.ndarray]
    local: list[RemoteRegion]
    remote: list[RemoteRegion]
    local_geometry: np.ndarray  # geometry(local)
    remote_geometry: np.ndarray

    @functools.cached_property
    def known(self) -> bool:
        """Whether ``merge_bound`` knows these rows' geometry (worked out once, not per read)."""
        return known_geometry(self.local_geometry, self.remote_geometry)


@dataclass
class LegPlan:
    """The descriptors of one leg: indices into the prepared lists or, once consecutive
    blocks were merged, explicit ``[addr, len, device]`` rows (``runs``)."""

    local_idx: np.ndarray
    remote_idx: np.ndarray
    nbytes: int
    runs: tuple[np.ndarray, np.ndarray] | None = None
    chunk: int = 1  # descriptors per posted chunk

    @property
    def count(self) -> int:
        return len(self.runs[0]) if self.runs is not None else len(self.local_idx)


def strided_rows(regions: list[RemoteRegion], num_blocks: int) -> np.ndarray:
    """NIXL's strided N x 5 form: one row (addr, len, dev, stride, count) per region."""
    rows = np.empty((len(regions), 5), dtype=np.int64)
    for i, r in enumerate(regions):
        rows[i] = (r.addr, r.block_len, r.device_id, r.block_stride, num_blocks)
    return rows


def geometry(rows: list[RemoteRegion]) -> np.ndarray:
    """``[addr, block_len, stride, device]`` per row."""
    return np.array([(r.addr, r.block_len, r.block_stride, r.device_id) for r in rows],
                    dtype=np.int64).reshape(-1, 4)


def desc_indices(rows: np.ndarray, num_blocks: int, block_ids: np.ndarray) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in every row, row-major (int32 for NIXL)."""
    return (rows.astype(np.int64)[:, None] * num_blocks + block_ids[None, :]).ravel().astype(np.int32)


def merge_rows(pairs: list[tuple[RemoteRegion, RemoteRegion]]) -> list[tuple[RemoteRegion, RemoteRegion]]:
    """Merge consecutive (local row, remote row) pairs that continue each other on both
    sides: row i ends where row i+1 starts, locally and remotely, with the same block
    strides and devices. Then every block's two runs are one, at every block index (both
    rows move by the same stride), so the merged row moves exactly their bytes. A
    block-outermost layout (vLLM's BLHNC/BLNHC: one block of all layers is one run) read
    between equal TP sizes becomes one row; a layer-outer one keeps one per region."""
    out: list[tuple[RemoteRegion, RemoteRegion]] = []
    for lr, rr in pairs:
        if out:
            pl, pr = out[-1]
            if (pl.addr + pl.block_len == lr.addr and pr.addr + pr.block_len == rr.addr
                    and pl.block_stride == lr.block_stride and pr.block_stride == rr.block_stride
                    and pl.device_id == lr.device_id and pr.device_id == rr.device_id
                    and pl.block_len + lr.block_len <= lr.block_stride
                    and pr.block_len + rr.block_len <= rr.block_stride):
                out[-1] = (msgspec.structs.replace(pl, block_len=pl.block_len + lr.block_len),
                           msgspec.structs.replace(pr, block_len=pr.block_len + rr.block_len))
                continue
        out.append((lr, rr))
    return out


def merge_runs(local_rows: np.ndarray, remote_rows: np.ndarray, local_nb: int, remote_nb: int,
               li: np.ndarray, ri: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors ``li``/``ri`` (``row * num_blocks + block``, row geometry in
    ``*_rows[row] = (addr, block_len, stride, device)``) as [addr, len, device] rows where
    each run of consecutive descriptors that continue each other on both sides, in the same
    row, is one: a request whose consecutive local blocks map to consecutive remote blocks
    moves them in one descriptor per row where a block is contiguous with the next (a
    layer-outer region, or a block-outermost block of every layer). Runs never leave their
    row, so each stays inside the one registered memory its region lives in; a gap on either
    side ends a run."""
    lrow, lblk = np.divmod(li.astype(np.int64), local_nb)
    rrow, rblk = np.divmod(ri.astype(np.int64), remote_nb)
    lg, rg = local_rows[lrow], remote_rows[rrow]
    lstart = lg[:, 0] + lblk * lg[:, 2]
    rstart = rg[:, 0] + rblk * rg[:, 2]
    length = lg[:, 1]
    brk = np.ones(len(li), dtype=bool)
    brk[1:] = ((lrow[1:] != lrow[:-1]) | (rrow[1:] != rrow[:-1])
               | (lstart[1:] != lstart[:-1] + length[:-1]) | (rstart[1:] != rstart[:-1] + length[:-1]))
    first = np.flatnonzero(brk)
    lens = np.add.reduceat(length, first) if len(first) else length[:0]
    return (np.stack([lstart[first], lens, lg[first, 3]], axis=1),
            np.stack([rstart[first], lens, rg[first, 3]], axis=1))


def pair_rows(plan: RankPlan, local_regions: list[RemoteRegion], remote_regions: list[RemoteRegion],
              min_blocks: int) -> PairRows:
    """The rows of one plan between a local rank's regions and a remote rank's (absolute
    addresses). ``min_blocks``: the fewer blocks of the two sides; with fewer than 2, two
    touching regions could be two registrations side by side in memory, and a merged row
    must stay inside one, so nothing is merged."""
    lslice, rslice = plan.region_slices(len(local_regions))
    lregs = [local_regions[i] for i in lslice]
    rregs = [remote_regions[i] for i in rslice]
    lrows: list[RemoteRegion] = []
    rrows: list[RemoteRegion] = []
    rows: list[np.ndarray] = []
    for segs in plan.segments:
        runs = [(RemoteRegion(addr=lreg.addr + s.local_off, block_len=s.length,
                              block_stride=lreg.block_stride, device_id=lreg.device_id),
                 RemoteRegion(addr=rreg.addr + s.remote_off, block_len=s.length,
                              block_stride=rreg.block_stride, device_id=rreg.device_id))
                for lreg, rreg in zip(lregs, rregs, strict=True) for s in segs]
        merged = merge_rows(runs) if min_blocks > 1 else runs
        rows.append(np.arange(len(lrows), len(lrows) + len(merged), dtype=np.int64))
        lrows += [lr for lr, _ in merged]
        rrows += [rr for _, rr in merged]
    return PairRows(rows, lrows, rrows, geometry(lrows), geometry(rrows))


def paired_blocks(subs: int, pairs: list[tuple[int, int, int]], lb: np.ndarray,
                  rb: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per sub-position ``q`` that has pairs: the local and remote blocks paired there, in order."""
    for q in range(subs):
        sel = [(a, b) for a, b, qq in pairs if qq == q]
        if sel:
            yield q, lb[[a for a, _ in sel]], rb[[b for _, b in sel]]


def leg_indices(rows: list[np.ndarray], local_geometry: np.ndarray, pairs: list[tuple[int, int, int]],
                lb: np.ndarray, rb: np.ndarray, local_nb: int,
                remote_nb: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Local and remote descriptor indices of one leg, and the bytes they move.

    Grouped by sub-position, then row, then block: contiguous blocks stay adjacent.
    """
    return _indices(rows, local_geometry, list(paired_blocks(len(rows), pairs, lb, rb)), local_nb, remote_nb)


Parts = list[tuple[int, np.ndarray, np.ndarray]]  # (sub-position, its local blocks, its remote blocks)


def _indices(rows: list[np.ndarray], local_geometry: np.ndarray, parts: Parts, local_nb: int,
             remote_nb: int) -> tuple[np.ndarray, np.ndarray, int]:
    li_parts, ri_parts, nbytes = [], [], 0
    for q, lblocks, rblocks in parts:
        qrows = rows[q]
        li_parts.append(desc_indices(qrows, local_nb, lblocks))
        ri_parts.append(desc_indices(qrows, remote_nb, rblocks))
        nbytes += int(local_geometry[qrows, 1].sum()) * len(lblocks)
    if not li_parts:
        return np.empty(0, np.int32), np.empty(0, np.int32), 0
    return np.concatenate(li_parts), np.concatenate(ri_parts), nbytes


def merge_bound(rows: list[np.ndarray], local_geometry: np.ndarray, remote_geometry: np.ndarray,
                parts: Parts, known: bool | None = None) -> int:
    """At most how many descriptors ``merge_runs`` can save on these blocks, cheaply. A run
    goes on from one descriptor to the next of its row only where the next block's bytes
    start where this one's end, on both sides; a row is never longer than its stride
    (``merge_rows``), so that takes the next block id on both sides, and each such pair of
    neighbours saves at most one descriptor per row. A busy engine's random block ids have
    none: their read skips the merge (``plan_leg`` of 8 random blocks, 512 descriptors, here:
    122 -> 69 µs called after an idle pause, 45 -> 22 µs back to back). ``known``: what
    ``known_geometry`` says of these geometries, when the caller kept it."""
    if not (known_geometry(local_geometry, remote_geometry) if known is None else known):
        return sys.maxsize  # (a geometry it does not know: no bound, merge_runs decides)
    return sum(len(rows[q]) * _neighbours(lb, rb) for q, lb, rb in parts)


def known_geometry(local_geometry: np.ndarray, remote_geometry: np.ndarray) -> bool:
    """Rows no longer than their stride, and not empty, on both sides (``merge_bound``)."""
    return all(bool(((g[:, 1] > 0) & (g[:, 1] <= g[:, 2])).all()) for g in (local_geometry, remote_geometry))


def _neighbours(lb: np.ndarray, rb: np.ndarray) -> int:
    """Pairs of consecutive blocks that go on to the next block id on both sides (a few
    blocks: in Python, cheaper than four numpy calls)."""
    if len(lb) <= 64:
        ls, rs = lb.tolist(), rb.tolist()
        return sum(1 for i in range(len(ls) - 1) if ls[i + 1] - ls[i] == 1 and rs[i + 1] - rs[i] == 1)
    return int(np.count_nonzero((np.diff(lb) == 1) & (np.diff(rb) == 1)))


def plan_leg(pr: PairRows, pairs: list[tuple[int, int, int]], lb: np.ndarray, rb: np.ndarray, local_nb: int,
             remote_nb: int, *, merge: bool, chunk_bytes: int) -> LegPlan | None:
    """The descriptors of one leg (None: it moves nothing), consecutive blocks merged into
    runs where that saves at least ``MERGE_MIN_SAVED`` descriptors, posted ``chunk_bytes``
    at a time."""
    rows, local_geometry, remote_geometry = pr.rows, pr.local_geometry, pr.remote_geometry
    parts = list(paired_blocks(len(rows), pairs, lb, rb))
    li, ri, nbytes = _indices(rows, local_geometry, parts, local_nb, remote_nb)
    if not len(li):
        return None
    leg = LegPlan(li, ri, nbytes)
    # (runs never leave their row: a leg of one block has nothing to merge)
    if (merge and len(pairs) > 1 and len(li) > MERGE_MIN_SAVED
            and merge_bound(rows, local_geometry, remote_geometry, parts, pr.known) >= MERGE_MIN_SAVED):
        runs = merge_runs(local_geometry, remote_geometry, local_nb, remote_nb, li, ri)
        if len(li) - len(runs[0]) >= MERGE_MIN_SAVED:
            leg.runs = runs
    largest = int((leg.runs[0] if leg.runs is not None else local_geometry)[:, 1].max())
    leg.chunk = max(1, chunk_bytes // largest)
    return leg


def state_pairs(n: int) -> list[tuple[int, int, int]]:
    """State blocks (Mamba/GDN) pair one to one and move only in the state regions."""
    return [(i, i, 0) for i in range(n)]
