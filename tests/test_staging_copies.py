"""The staging copies (``kvxfer.sidecar.nixl_copies.gather`` / ``scatter``) move exactly what
one ``memmove`` per run moves, whichever path they take: a few runs or long ones one by one,
granules through an overlapping window, or (granules that are whole rows from the first)
back-to-back rows: ``np.put`` to scatter, ``index_select`` to gather."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.sidecar.nixl_copies import gather, scatter

SPAN = 1 << 16


@st.composite
def runs_in_a_span(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Disjoint runs inside a span, (offset, length) in a drawn order; half the time on a grid
    of their unit (the fast scatter's case), else shifted off it by multiples of 8 bytes."""
    unit = draw(st.sampled_from([64, 128, 256, 512]))
    aligned = draw(st.booleans())
    n = draw(st.integers(1, 120))
    sizes = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=n, max_size=n))  # (0: an empty run)
    at, runs = 0, []
    for k in sizes:
        gap = draw(st.integers(0, 3)) * unit + (0 if aligned else draw(st.integers(0, 7)) * 8)
        at += gap
        if at + k * unit > SPAN:
            break
        runs.append((at, k * unit))
        at += k * unit
    order = draw(st.permutations(range(len(runs))))
    return [runs[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(runs_in_a_span(), st.integers(0, 2**32 - 1))
def test_gather_and_scatter_move_what_memmove_moves(runs: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, SPAN, dtype=np.uint8)
    base = src.ctypes.data
    arr = np.array([(base + off, n) for off, n in runs], dtype=np.int64)
    total = int(arr[:, 1].sum()) if len(arr) else 0
    want = np.concatenate([src[off:off + n] for off, n in runs]) if runs else np.zeros(0, np.uint8)

    slot = np.zeros(max(total, 1), np.uint8)
    assert gather(slot.ctypes.data, arr) == total
    assert np.array_equal(slot[:total], want)

    # the slot back into other memory at the same offsets: pieces [dst addr, slot offset, len]
    dst = np.zeros(SPAN, np.uint8)
    at, pieces = 0, []
    for off, n in runs:
        pieces.append((dst.ctypes.data + off, at, n))
        at += n
    order = rng.permutation(len(pieces))  # (pieces come in any order: sorted by slot offset inside)
    scatter(slot.ctypes.data, np.array(pieces, dtype=np.int64)[order].reshape(-1, 3))
    expect = np.zeros(SPAN, np.uint8)
    for off, n in runs:
        expect[off:off + n] = src[off:off + n]
    assert np.array_equal(dst, expect)


def test_a_scatter_on_the_grid_lands_every_row_where_it_belongs() -> None:
    """64K head slices of 256 B, every 8th row of a 16 MiB span (the staged NHD case): the
    np.put path, checked byte for byte."""
    g, n = 256, 8192
    dst = np.zeros(n * 8 * g, np.uint8)
    rows = np.random.default_rng(1).permutation(n * 8)[:n]
    slot = np.random.default_rng(2).integers(0, 256, n * g, dtype=np.uint8)
    pieces = np.stack([dst.ctypes.data + rows * g, np.arange(n) * g, np.full(n, g)], axis=1).astype(np.int64)
    scatter(slot.ctypes.data, pieces)
    view = dst.reshape(-1, g)
    assert np.array_equal(view[rows], slot.reshape(-1, g))
    untouched = np.ones(n * 8, bool)
    untouched[rows] = False
    assert not view[untouched].any()


def test_a_gather_on_the_grid_takes_every_row_in_its_order() -> None:
    """16K head slices of 1 KiB, one of every two rows of random 16-row blocks (the staged
    NHD 1 -> 2 case): the back-to-back rows path, checked byte for byte and in order."""
    g, n = 1024, 16384
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1024 * 32 * g, dtype=np.uint8)
    blocks = rng.permutation(1024)[:n // 16]
    rows = (blocks[:, None] * 32 + np.arange(16)[None, :] * 2 + 1).ravel()
    runs = np.stack([src.ctypes.data + rows * g, np.full(n, g)], axis=1).astype(np.int64)
    slot = np.zeros(n * g, np.uint8)
    assert gather(slot.ctypes.data, runs) == n * g
    assert np.array_equal(slot.reshape(-1, g), src.reshape(-1, g)[rows])


def test_empty_runs_copy_nothing() -> None:
    """Runs of no bytes (more than the few copied one by one): nothing moves, nothing fails
    (the granule of lengths all 0 is 0: found by the property test above)."""
    buf = np.zeros(64, np.uint8)
    runs = np.array([(buf.ctypes.data, 0)] * 20, dtype=np.int64)
    assert gather(buf.ctypes.data, runs) == 0
    scatter(buf.ctypes.data, np.array([(buf.ctypes.data, 0, 0)] * 20, dtype=np.int64))
    assert not buf.any()


# ---------------------------------------------------------------------- VRAM staging's copies


@st.composite
def runs_in_tensors(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Two or three memories (sizes) and disjoint runs in them, (memory, offset, length) in a
    drawn order, on a grid of their unit or off it by multiples of 2 bytes (head slices,
    blocks, odd pieces)."""
    unit = draw(st.sampled_from([2, 64, 256, 4096]))
    aligned = draw(st.booleans())
    sizes = [draw(st.integers(4, 64)) * unit for _ in range(draw(st.integers(1, 3)))]
    runs = []
    for m, size in enumerate(sizes):
        at = 0
        for _ in range(draw(st.integers(0, 30))):
            at += draw(st.integers(0, 2)) * unit + (0 if aligned else draw(st.integers(0, 3)) * 2)
            k = draw(st.integers(1, 3))
            if at + k * unit > size:
                break
            runs.append((m, at, k * unit))
            at += k * unit
    order = draw(st.permutations(range(len(runs))))
    return sizes, [runs[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(runs_in_tensors(), st.integers(0, 2**32 - 1))
def test_vram_copies_move_what_slicing_moves(case: tuple[list[int], list[tuple[int, int, int]]],
                                             seed: int) -> None:
    """``copy_runs`` (the gather and scatter of VRAM staging: torch ops on the arena's device)
    run here on CPU tensors, which the same ops treat alike: a gather puts each run's bytes
    back to back in the slot in order, a scatter puts them back, and nothing else moves.
    The bases are only numbers to it (addresses of memory on a device): here far apart."""
    import torch

    from kvxfer.sidecar.nixl_copies import copy_runs

    sizes, runs = case
    rng = np.random.default_rng(seed)
    mems = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    bases = [(1 << 40) + i * (1 << 32) for i in range(len(sizes))]
    order = sorted(range(len(sizes)), key=lambda i: bases[i])
    mem = [(bases[i], mems[i]) for i in order]
    arr = np.array([(bases[m] + off, n) for m, off, n in runs], dtype=np.int64).reshape(-1, 2)
    total = sum(n for _, _, n in runs)
    slot = torch.zeros(total + 16, dtype=torch.uint8)
    copy_runs(slot[:total], arr, mem, into_slot=True)
    want = b"".join(mems[m][off:off + n].numpy().tobytes() for m, off, n in runs)
    assert slot[:total].numpy().tobytes() == want
    assert not slot[total:].any()  # (nothing past the slot's end)

    before = [t.clone() for t in mems]
    for m, off, n in runs:  # wipe the runs, scatter them back from a slot of other bytes
        mems[m][off:off + n] = 0
    back = torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8))
    copy_runs(back, arr, mem, into_slot=False)
    at = 0
    for m, off, n in runs:
        assert mems[m][off:off + n].numpy().tobytes() == back[at:at + n].numpy().tobytes()
        before[m][off:off + n] = back[at:at + n]
        at += n
    for t, b in zip(mems, before, strict=True):
        assert torch.equal(t, b)  # every byte outside the runs untouched


def test_a_vram_run_outside_the_ranks_memory_is_refused_before_anything_moves() -> None:
    import pytest
    import torch

    from kvxfer.errors import RequestError
    from kvxfer.sidecar.nixl_copies import copy_runs

    mem = [(1 << 40, torch.zeros(4096, dtype=torch.uint8))]
    slot = torch.ones(1024, dtype=torch.uint8)
    for bad in ([(1 << 40) + 3584, 1024], [(1 << 40) - 512, 1024], [(1 << 41), 1024]):
        with pytest.raises(RequestError, match="outside"):
            copy_runs(slot, np.array([bad], dtype=np.int64), mem, into_slot=False)
    assert not mem[0][1].any()


def test_empty_runs_among_granule_sized_ones_move_nothing_and_touch_nothing() -> None:
    """Runs of exactly one granule mixed with empty ones (found by the property test above):
    the one-granule-each shortcut kept the empty runs' starts, so the gather's rows outnumbered
    its bytes (it raised) and the scatter's ``np.put`` repeated the slot's rows cyclically into
    the empty pieces' addresses, memory no piece names."""
    g = 64
    src = np.arange(32 * g, dtype=np.uint32).view(np.uint8)[:32 * g].copy()
    base = src.ctypes.data
    offsets = [(i * 2 + 1) * g for i in range(15)]  # 15 empty runs, every other row
    runs = np.array([(base + o, 0) for o in offsets] + [(base + 30 * g, g)], dtype=np.int64)
    slot = np.zeros(g, np.uint8)
    assert gather(slot.ctypes.data, runs) == g
    assert np.array_equal(slot, src[30 * g:31 * g])

    dst = np.zeros(32 * g, np.uint8)
    pieces = np.array([(dst.ctypes.data + o, 0, 0) for o in offsets] + [(dst.ctypes.data + 30 * g, 0, g)],
                      dtype=np.int64)
    scatter(slot.ctypes.data, pieces)
    expect = np.zeros(32 * g, np.uint8)
    expect[30 * g:31 * g] = src[30 * g:31 * g]
    assert np.array_equal(dst, expect), np.flatnonzero(dst != expect)[:8]
