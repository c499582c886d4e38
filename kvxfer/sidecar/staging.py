"""Staged reads (#35): a read of many small pieces moved as one contiguous transfer. Pure:
numpy arrays in, arrays out; no NIXL, no threads, no clock.

NIXL pays ~10 us per descriptor here (FIELD_NOTES: 32 KiB blocks move at ~3 GB/s, one
16 MiB descriptor at 6.5-7.8 GB/s), and a head slice of an NHD block between different TP
sizes is one descriptor per token. A staged read instead: the prefill sidecar *gathers* the
read's remote pieces into a slot of its staging arena (its own registered memory), the
decode sidecar reads that slot into a slot of its own arena in a few large descriptors, then
*scatters* the pieces into its blocks. Two memory copies (~10 GB/s each) for one large
transfer: worth it when the read's descriptors average under a few tens of KiB.

The byte stream in the two slots is defined by the decode alone: the pieces of every leg
(remote rank) in the order of their remote addresses, legs one after the other. The decode
sends the remote side as merged runs (``StagedPlan.remote_runs``: [addr, len] in stream
order); the prefill copies exactly those into its slot, after checking that every run lies
inside blocks it holds for the request (``held_intervals``, ``runs_inside``); the decode
scatters its slot by ``StagedPlan.scatter`` ([local addr, stream offset, len]). Sorting by
remote address makes the prefill's gather a few large runs (whole blocks of each remote
rank) and leaves the fine-grained side, if any, to the decode's scatter.

``SlotBook`` is the arena's allocator (first fit, aligned, each slot with an expiry).

On a GPU (``--cuda on``) there is an arena per CUDA device, in memory the sidecar itself
allocated (``cuMemAlloc``, ``--vram-staging-mib``): UCX moves only such memory over cuda_ipc between
processes on a machine without IMEX (README "GPU paths"), so every VRAM read of a rank is
staged through the arena of its device (``arena_device``), whatever its descriptors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.protocol import RankInfo, RemoteRegion
from kvxfer.sidecar.plan import PairRows, pair_rows, paired_blocks
from kvxfer.topology import BlockPairing, RankPlan

# Staging costs two copies and a round trip before the transfer; below this many direct
# descriptors a read is never staged (it costs a few ms at most either way).
STAGE_MIN_DESCS = 128
SMALL_SHARE = 4 << 20  # a rank's read this small is staged more readily with more ranks
SLOT_ALIGN = 4096


@dataclass(frozen=True)
class LegPieces:
    """One leg's pieces, in the direct read's order: local and remote start addresses and
    lengths (int64 arrays of one size)."""

    local: np.ndarray
    remote: np.ndarray
    length: np.ndarray


def leg_pieces(rows: list[np.ndarray], local_geometry: np.ndarray, remote_geometry: np.ndarray,
               pairs: list[tuple[int, int, int]], lb: np.ndarray, rb: np.ndarray) -> LegPieces:
    """A leg's pieces: per sub-position, every row with every block paired there, row-major as
    ``plan.leg_indices`` orders the direct read's descriptors (computed from rows and blocks,
    not from those indices divided back: that was a third of a rank's planning)."""
    local, remote, length = [], [], []
    for q, la, ra in paired_blocks(len(rows), pairs, lb, rb):
        lg, rg = local_geometry[rows[q]], remote_geometry[rows[q]]
        local.append((lg[:, :1] + la[None, :] * lg[:, 2:3]).ravel())
        remote.append((rg[:, :1] + ra[None, :] * rg[:, 2:3]).ravel())
        length.append(np.repeat(lg[:, 1], len(la)))
    if not local:
        empty = np.empty(0, dtype=np.int64)
        return LegPieces(empty, empty.copy(), empty.copy())
    return LegPieces(np.concatenate(local), np.concatenate(remote), np.concatenate(length))


def read_pieces(plans: list[RankPlan], pairing: BlockPairing, local_regions: list[RemoteRegion],
                local_nb: int, remote: dict[tuple[int, int], tuple[list[RemoteRegion], int]],
                local_blocks: list[int], remote_blocks: list[int],
                rows_of: dict[tuple[int, ...], PairRows] | None = None) -> list[LegPieces]:
    """The pieces of a read's attention legs, as ``Registrations.legs`` plans them
    (``remote``: (pp, tp) -> the remote rank's regions and block count; ``rows_of``: a
    cache of ``pair_rows`` by plan, for one pair of registrations)."""
    pairs = pairing.pairs(len(local_blocks), len(remote_blocks))
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    out = []
    for plan in plans:
        if plan.state:
            raise ValueError("state blocks are not staged")
        regions, remote_nb = remote[(plan.remote_pp, plan.remote_rank)]
        key = (plan.remote_pp, plan.remote_rank, plan.local_region0, plan.remote_region0, plan.num_regions)
        rows = rows_of.get(key) if rows_of is not None else None
        if rows is None:
            rows = pair_rows(plan, local_regions, regions, min(local_nb, remote_nb))
            if rows_of is not None:
                rows_of[key] = rows
        out.append(leg_pieces(rows.rows, rows.local_geometry, rows.remote_geometry, pairs, lb, rb))
    return out


def _breaks(*starts_and_length: np.ndarray) -> np.ndarray:
    """Indices where a run starts: piece i continues piece i-1 when every ``starts`` array
    (all but the last argument, which is the lengths) continues where the previous ended."""
    *starts, length = starts_and_length
    n = len(length)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        cont = np.ones(n - 1, dtype=bool)
        for s in starts:
            cont &= s[1:] == s[:-1] + length[:-1]
        brk[1:] = ~cont
    return np.flatnonzero(brk)


def _merge(starts: list[np.ndarray], length: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    first = _breaks(*starts, length)
    lens = np.add.reduceat(length, first) if len(first) else length[:0]
    return [s[first] for s in starts], lens


@dataclass(frozen=True)
class StagedPlan:
    nbytes: int
    remote_runs: list[np.ndarray]  # per leg: int64 (n, 2) [remote addr, len], in stream order
    scatter: np.ndarray  # int64 (m, 3): [local addr, stream offset, len], merged
    direct_descs: int  # descriptors the direct read would post (consecutive pieces merged)

    @property
    def gather_runs(self) -> int:
        return sum(len(r) for r in self.remote_runs)


def staged_plan(legs: list[LegPieces]) -> StagedPlan:
    """The byte stream of a staged read (see the module docstring)."""
    remote_runs, scatter, direct, offset = [], [], 0, 0
    for leg in legs:
        n = len(leg.length)
        if n == 0:
            remote_runs.append(np.empty((0, 2), dtype=np.int64))
            continue
        direct += len(_breaks(leg.local, leg.remote, leg.length))
        order = np.argsort(leg.remote, kind="stable")
        local, remote, length = leg.local[order], leg.remote[order], leg.length[order]
        stream = offset + np.concatenate(([0], np.cumsum(length)[:-1]))
        (rstart,), rlen = _merge([remote], length)
        remote_runs.append(np.stack([rstart, rlen], axis=1))
        (lstart, sstart), slen = _merge([local, stream], length)
        scatter.append(np.stack([lstart, sstart, slen], axis=1))
        offset += int(length.sum())
    return StagedPlan(offset, remote_runs,
                      np.concatenate(scatter) if scatter else np.empty((0, 3), dtype=np.int64), direct)


def _clip(rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, a: int, b: int, addr_cols: list[int],
          len_col: int) -> np.ndarray:
    """The rows whose stream bytes ``[starts, starts + lens)`` overlap ``[a, b)``, cut to it:
    their address columns moved by what was cut off the front, their lengths shortened."""
    keep = (starts < b) & (starts + lens > a)
    out = rows[keep].copy()
    s, n = starts[keep], lens[keep]
    head = np.maximum(a - s, 0)
    for c in addr_cols:
        out[:, c] += head
    out[:, len_col] = np.minimum(s + n, b) - np.maximum(s, a)
    return out


def window_cuts(lengths: np.ndarray, max_bytes: int, max_runs: int) -> list[int]:
    """Stream offsets that cut runs of ``lengths`` (back to back) into windows of at most
    ``max_bytes`` bytes and ``max_runs`` runs each: every ``max_bytes`` (so no window is larger
    than the one before it, and a slot freed for the next always has room for it), earlier
    where ``max_runs`` runs end first. [0, ..., total]."""
    if max_bytes <= 0 or max_runs <= 0:
        raise ValueError("a window needs room for a byte and a run")
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(ends[-1]) if len(ends) else 0
    cuts, at = [0], 0
    while at < total:
        j = int(np.searchsorted(ends, at, side="right"))  # the first run not wholly before ``at``
        at = min(at + max_bytes, int(ends[min(j + max_runs - 1, len(ends) - 1)]), total)
        cuts.append(at)
    return cuts


def windows_of(plan: StagedPlan, max_bytes: int, max_runs: int,
               groups: Sequence[int] = ()) -> list[StagedPlan]:
    """A staged read too large for one slot (or one StageRequest's runs) cut into windows of
    its byte stream (``window_cuts``), read one after another through one slot. Each window
    is a plan of its own: its legs' runs, its scatter pieces with offsets from its start.
    ``groups``: each leg's group (its prefill rank's GPU); a window never spans two groups
    (legs are back to back in the stream: it is cut where the group changes, and each stretch
    of one group in windows of its own)."""
    if not plan.remote_runs:
        return []
    lens = np.concatenate([r[:, 1] for r in plan.remote_runs])
    ends = np.cumsum(lens)
    total = int(ends[-1]) if len(ends) else 0
    leg_ends = [int(e) for e in np.cumsum([int(r[:, 1].sum()) for r in plan.remote_runs])]
    full = [k for k, r in enumerate(plan.remote_runs) if len(r)]  # (an empty leg cuts nothing)
    bounds = [0, *sorted({leg_ends[k] for k, n in zip(full, full[1:], strict=False)
                          if groups and groups[k] != groups[n] and 0 < leg_ends[k] < total}), total]
    cuts = [0]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # (a and b end runs: legs end runs)
        i, j = (int(np.searchsorted(ends, x, side="right")) for x in (a, b))
        cuts += [a + c for c in window_cuts(lens[i:j], max_bytes, max_runs)[1:]]
    # each leg's runs' stream offsets (legs one after the other)
    starts = np.split(np.cumsum(lens) - lens, np.cumsum([len(r) for r in plan.remote_runs])[:-1])
    sc = plan.scatter
    out = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        runs = [_clip(r, st, r[:, 1], a, b, [0], 1) for r, st in zip(plan.remote_runs, starts, strict=True)]
        pieces = _clip(sc, sc[:, 1], sc[:, 2], a, b, [0, 1], 2)
        pieces[:, 1] -= a
        out.append(StagedPlan(b - a, runs, pieces, 0))
    return out


def worth_staging(plan: StagedPlan, below_bytes: int, min_descs: int = STAGE_MIN_DESCS,
                  ranks: int = 1) -> bool:
    """Whether staging should beat the direct read: many descriptors, small on average.
    ``ranks``: the decode engine's TP size. A share of at most ``SMALL_SHARE`` is staged below
    ``ranks`` times the size: each rank's direct read pays a read's fixed cost (~1-2 ms on 2
    cores), where one staged request serves every rank (8 -> 8 NHD: 1.1 -> 1.3-1.4 GB/s); a
    larger share's copy dwarfs that cost, and staging would only add copies (MLA's replicated
    latent: every rank reads 16 MiB, ~3.8 GB/s direct, ~3 staged)."""
    if below_bytes <= 0 or plan.nbytes == 0 or plan.direct_descs < min_descs:
        return False
    if plan.nbytes <= SMALL_SHARE:
        below_bytes *= max(1, ranks)
    return plan.nbytes < below_bytes * plan.direct_descs


def arena_device(info: RankInfo) -> int | None:
    """The arena a rank's reads stage through: -1 (host) for DRAM, its CUDA device for VRAM;
    None: its regions lie on several devices (it is never staged)."""
    if info.mem_type != "VRAM":
        return -1
    devices = {r.device_id for r in info.regions}
    return devices.pop() if len(devices) == 1 else None


# ---------------------------------------------------------------------- the prefill's check


def held_intervals(regions: np.ndarray, blocks: np.ndarray, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The byte intervals of held blocks in every region (``regions``: rows ``[addr,
    block_len, stride]``), sorted and merged: (starts, ends). Block ids outside
    ``[0, num_blocks)`` hold nothing."""
    blocks = np.unique(np.asarray(blocks, dtype=np.int64))
    blocks = blocks[(blocks >= 0) & (blocks < num_blocks)]
    if not len(blocks) or not len(regions):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    regions = np.asarray(regions, dtype=np.int64).reshape(-1, 3)
    starts = (regions[:, 0][:, None] + blocks[None, :] * regions[:, 2][:, None]).ravel()
    ends = starts + np.repeat(regions[:, 1], len(blocks))
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    # merge overlapping or touching intervals: a new one starts where none before reaches
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(starts)) - 1
    return starts[first], reach[last]


def runs_inside(runs: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> int:
    """The index of the first run ([addr, len] rows) not inside one interval; -1: all are.
    An empty run is never inside (nobody asks for nothing)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if not len(runs):
        return -1
    if not len(starts):
        return 0
    j = np.searchsorted(starts, runs[:, 0], side="right") - 1
    ok = (j >= 0) & (runs[:, 1] > 0)
    jj = np.clip(j, 0, None)
    ok &= runs[:, 1] <= ends[jj] - runs[:, 0]  # (not start + len <= end: a peer's run of [2**63 - 8,
    # 16] wrapped that sum negative, and the copy read from there: found by a review)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else -1


# ---------------------------------------------------------------------- the arena's slots


@dataclass
class _Slot:
    offset: int
    size: int
    key: Hashable
    expires: float


class SlotBook:
    """Slots of an arena of ``size`` bytes: first fit, ``align``-aligned, one per key, each
    with an expiry (a slot is never handed out again before ``free`` or ``expire``)."""

    def __init__(self, size: int, align: int = SLOT_ALIGN) -> None:
        self.size = size
        self.align = align
        self._slots: list[_Slot] = []  # sorted by offset
        self._by_key: dict[Hashable, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._by_key

    @property
    def used(self) -> int:
        return sum(s.size for s in self._slots)

    def offset(self, key: Hashable) -> int | None:
        slot = self._by_key.get(key)
        return slot.offset if slot is not None else None

    def alloc(self, nbytes: int, key: Hashable, expires: float) -> int | None:
        """A free slot's offset (None: no room, or ``key`` already has one)."""
        if nbytes <= 0 or key in self._by_key:
            return None
        size = -(-nbytes // self.align) * self.align
        at, pos = 0, 0
        for pos, s in enumerate([*self._slots, None]):
            end = s.offset if s is not None else self.size
            if end - at >= size:
                slot = _Slot(at, size, key, expires)
                self._slots.insert(pos, slot)
                self._by_key[key] = slot
                return at
            if s is not None:
                at = s.offset + s.size
        return None

    def free(self, key: Hashable) -> bool:
        slot = self._by_key.pop(key, None)
        if slot is None:
            return False
        self._slots.remove(slot)
        return True

    def expire(self, now: float) -> list[Hashable]:
        """Free every slot whose expiry passed; their keys."""
        gone = [s.key for s in self._slots if s.expires <= now]
        for key in gone:
            self.free(key)
        return gone


class Books:
    """The slot books of this sidecar's arenas, by device (-1: host), each made when its
    arena is first seen in ``spans`` (the NIXL port's (address, size) by device)."""

    def __init__(self, spans: dict[int, tuple[int, int]]) -> None:
        self._spans = spans  # (the port's own dict: arenas appear in it as devices register)
        self._books: dict[int, SlotBook] = {}

    def get(self, device: int) -> SlotBook | None:
        book = self._books.get(device)
        if book is None:
            span = self._spans.get(device)
            if span is None or span[1] <= 0:
                return None
            book = self._books[device] = SlotBook(span[1])
        return book

    def base(self, device: int) -> int:
        return self._spans[device][0]

    def free(self, key: Hashable) -> bool:
        return any([b.free(key) for b in self._books.values()])

    def expire(self, now: float) -> list[Hashable]:
        return [k for b in self._books.values() for k in b.expire(now)]

    def __len__(self) -> int:  # (the metrics thread's: a copy of the values, never the dict iterated)
        return sum(len(b) for b in list(self._books.values()))


def reader_name(pp: int, tp: int, engine: str) -> str:
    """A staging slot's reader as the prefill names it from its ``ReadNotice`` (engine "": by
    rank alone, as a prefill without ``Welcome.reader_engines`` does)."""
    return f"{pp}/{tp}@{engine}" if engine else f"{pp}/{tp}"
