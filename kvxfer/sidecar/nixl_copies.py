"""The staging copies (#35, #39): runs between raw addresses of this process, moved into and
out of a staging slot. Used on the NIXL port's thread (``kvxfer.sidecar.nixl_staging``).

The copies move runs between raw addresses of this process. The runs are cut into granules
of one size (the greatest common divisor of their lengths) and copied all at once through
an overlapping "window" view (one row per byte offset, indexed by each granule's start):
``torch.index_select`` gathers them into the contiguous slot (4-14 GiB/s on one core here
for 256 B-64 KiB granules), a numpy fancy assignment scatters the slot into them (3-17
GiB/s); a few large runs are plain ``memmove``s. Both release the GIL. Where the granules
all start a whole number of granules from the first (head slices, blocks: the usual case)
both go through a view of back-to-back rows instead: the scatter one void item per granule,
by ``np.put`` (16 MiB of 256 B head slices in 3.0 ms where the window took 5.6-6.6; memcpy of
the same bytes 2.5 ms), the gather by ``index_select`` on that contiguous tensor (16 MiB of
1 KiB head slices of random blocks: 2.4-2.8 ms where the window took 3.3-3.8; memcpy 0.8-1.1).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError

# Runs are copied one by one (memmove) when there are fewer than FEW_RUNS, when they average
# LONG_RUN or more, or when they share no granule of MIN_GRANULE bytes; else all at once,
# cut into granules of their lengths' greatest common divisor, through window views.
FEW_RUNS = 16
LONG_RUN = 256 << 10
MIN_GRANULE = 64


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


def _granules(starts: np.ndarray, lengths: np.ndarray, g: int = 0) -> tuple[np.ndarray, int]:
    """Runs cut into granules of one size (``g``, which divides every length; 0: the greatest
    common divisor of their lengths): each granule's start, in order, and the size."""
    g = g or int(np.gcd.reduce(lengths))
    if g <= 0:
        return starts, g
    counts = lengths // g
    if int(counts.min()) == int(counts.max()) == 1:  # (runs of the granule's size: each is one granule;
        return starts, g  # an empty run among them has none, which np.repeat below gives it)
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
    # back-to-back rows where every granule starts a whole number of granules from the first
    # (head slices, blocks: a contiguous tensor, index_select's fast path), else the window
    win, rows = _rows(starts, g) or _windows(starts, g)
    out = _view(dst, total).reshape(-1, g)
    torch.index_select(torch.from_numpy(win), 0, torch.from_numpy(rows), out=torch.from_numpy(out))
    return total


def gather_each(dst: int, runs: np.ndarray) -> int:
    at = dst
    for addr, n in runs.tolist():
        ctypes.memmove(at, addr, n)
        at += n
    return at - dst


def by_offset(pieces: np.ndarray) -> np.ndarray:
    """Scatter pieces ([dst addr, offset, len] rows) in order of offset (mostly so already)."""
    if len(pieces) > 1 and (pieces[1:, 1] < pieces[:-1, 1]).any():
        return pieces[np.argsort(pieces[:, 1], kind="stable")]
    return pieces


def scatter(src: int, pieces: np.ndarray) -> None:
    """Copy each piece ([dst addr, offset at ``src``, len] rows) from ``src + offset``; the
    pieces tile ``[src, src + their total)`` in order of offset."""
    pieces = by_offset(pieces)
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


def _tensor_rows(starts: np.ndarray, lengths: np.ndarray, base: int) -> tuple[np.ndarray, int]:
    """Runs inside memory at ``base`` cut into granules of one size that divides every
    length and every start's offset from ``base``: each granule's row in that memory seen
    as back-to-back rows of the size, in order, and the size."""
    rel = starts - base
    granules, g = _granules(rel, lengths, int(np.gcd.reduce(np.concatenate([lengths, rel]))))
    return granules // g, g


def copy_runs(slot: Any, runs: np.ndarray, mem: list[tuple[int, Any]], into_slot: bool) -> None:
    """Torch copies between ``slot`` (a contiguous uint8 tensor) and ``runs`` ([addr, len]
    rows, in the slot's order, back to back in it) of memory ``mem`` ([(base address, uint8
    tensor over it)], on the slot's device): a gather into the slot, or a scatter out of it.
    One ``index_select`` / ``index_copy_`` per stretch of runs in one tensor (a 2026-11-28
    H100 run: 1 GiB of 32 KiB pieces gathered in 3.8 ms, scattered in 3.7)."""
    import torch

    runs = runs[runs[:, 1] > 0]  # (an empty run moves nothing and has no granule)
    if not len(runs):
        return
    if not mem:
        raise RequestError(ErrorCode.INTERNAL, "runs to copy, and no memory of the rank's")
    bases = np.array([b for b, _ in mem], dtype=np.int64)
    sizes = np.array([t.numel() for _, t in mem], dtype=np.int64)
    addrs, lens = runs[:, 0], runs[:, 1]
    which = np.searchsorted(bases, addrs, side="right") - 1
    inside = (which >= 0) & (lens <= bases[which] + sizes[which] - addrs)  # (no sum that wraps)
    if not inside.all():
        raise RequestError(ErrorCode.INTERNAL, f"run {int(np.argmin(inside))} lies outside the rank's memory")
    cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(runs)]
    offs = np.concatenate(([0], np.cumsum(lens)))
    stretches, rows = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        base, t = mem[int(which[lo])]
        r, g = _tensor_rows(addrs[lo:hi], lens[lo:hi], base)
        stretches.append((t, g, int(offs[lo]), int(offs[hi]), len(r)))
        rows.append(r)
    host = torch.from_numpy(np.concatenate(rows))  # (every stretch's rows in one copy to the device)
    if slot.is_cuda:
        host = host.pin_memory()
    idx_all = host.to(slot.device, non_blocking=True)
    at = 0
    for t, g, lo_b, hi_b, n in stretches:
        view = t[:(t.numel() // g) * g].view(-1, g)
        part = slot[lo_b:hi_b].view(-1, g)
        idx = idx_all[at:at + n]
        at += n
        if into_slot:
            torch.index_select(view, 0, idx, out=part)
        else:
            view.index_copy_(0, idx, part)
