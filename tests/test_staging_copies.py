"""The staging copies (``kvxfer.sidecar.nixl_staging.gather`` / ``scatter``) move exactly what
one ``memmove`` per run moves, whichever path they take: a few runs or long ones one by one,
granules through an overlapping window, or (a scatter whose granules are whole rows from the
first) back-to-back rows by ``np.put``."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.sidecar.nixl_staging import gather, scatter

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


def test_empty_runs_copy_nothing() -> None:
    """Runs of no bytes (more than the few copied one by one): nothing moves, nothing fails
    (the granule of lengths all 0 is 0: found by the property test above)."""
    buf = np.zeros(64, np.uint8)
    runs = np.array([(buf.ctypes.data, 0)] * 20, dtype=np.int64)
    assert gather(buf.ctypes.data, runs) == 0
    scatter(buf.ctypes.data, np.array([(buf.ctypes.data, 0, 0)] * 20, dtype=np.int64))
    assert not buf.any()
