"""The staged read's pure half (kvxfer.sidecar.staging), property-tested against brute force:
the byte stream both sides agree on moves exactly what the direct read moves, the prefill's
containment check accepts exactly the runs inside held blocks, slots never overlap."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.sidecar.staging import (
    SLOT_ALIGN,
    SMALL_SHARE,
    LegPieces,
    SlotBook,
    StagedPlan,
    held_intervals,
    runs_inside,
    staged_plan,
    window_cuts,
    windows_of,
    worth_staging,
)


def pieces_of(local_idx: np.ndarray, remote_idx: np.ndarray, local_geometry: np.ndarray,
              remote_geometry: np.ndarray, local_nb: int, remote_nb: int) -> LegPieces:
    """The pieces of descriptor indices (``row * num_blocks + block``; geometry rows
    ``[addr, block_len, stride, device]``, as ``kvxfer.sidecar.plan`` makes them): the
    reference ``staging.leg_pieces`` is checked against."""
    lrow, lblk = np.divmod(np.asarray(local_idx, dtype=np.int64), local_nb)
    rrow, rblk = np.divmod(np.asarray(remote_idx, dtype=np.int64), remote_nb)
    lg, rg = local_geometry[lrow], remote_geometry[rrow]
    return LegPieces(lg[:, 0] + lblk * lg[:, 2], rg[:, 0] + rblk * rg[:, 2], lg[:, 1].copy())


LOCAL, REMOTE = 1 << 20, 1 << 22  # base addresses of the simulated memories
SIZE = 4096


@st.composite
def legs(draw: st.DrawFn) -> list[LegPieces]:
    """Legs of pieces: local pieces disjoint (a byte is written once), remote ones anywhere
    (replicated KV reads one remote byte into several places)."""
    cuts = sorted(draw(st.sets(st.integers(1, SIZE - 1), min_size=1, max_size=40)))
    bounds = [0, *cuts, SIZE]
    local = [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
    local = draw(st.permutations(local))
    keep = draw(st.integers(1, len(local)))
    out, i = [], 0
    n_legs = draw(st.integers(1, 3))
    for leg in range(n_legs):
        take = local[i:keep] if leg == n_legs - 1 else local[i:i + draw(st.integers(0, keep - i))]
        i += len(take)
        rem = [draw(st.integers(0, SIZE - n)) for _, n in take]
        out.append(LegPieces(np.array([LOCAL + a for a, _ in take], dtype=np.int64),
                             np.array([REMOTE + SIZE * leg + r for r in rem], dtype=np.int64),
                             np.array([n for _, n in take], dtype=np.int64)))
    return out


def run_staged(legs_: list[LegPieces], remote: np.ndarray) -> np.ndarray:
    plan = staged_plan(legs_)
    stream = np.concatenate([remote[a - REMOTE:a - REMOTE + n] for runs in plan.remote_runs for a, n in runs]
                            or [np.empty(0, np.uint8)])
    assert len(stream) == plan.nbytes
    local = np.zeros(SIZE, np.uint8)
    for a, off, n in plan.scatter:
        local[a - LOCAL:a - LOCAL + n] = stream[off:off + n]
    return local


@settings(max_examples=300, deadline=None)
@given(legs(), st.integers(0, 2**31))
def test_staged_moves_what_the_direct_read_moves(legs_: list[LegPieces], seed: int) -> None:
    remote = np.random.default_rng(seed).integers(0, 256, SIZE * 3, dtype=np.uint8)
    want = np.zeros(SIZE, np.uint8)
    for leg in legs_:
        for a, r, n in zip(leg.local, leg.remote, leg.length, strict=True):
            want[a - LOCAL:a - LOCAL + n] = remote[r - REMOTE:r - REMOTE + n]
    assert np.array_equal(run_staged(legs_, remote), want)


@settings(max_examples=150, deadline=None)
@given(legs(), st.integers(0, 2**31), st.integers(1, 1500), st.integers(1, 6))
def test_a_read_in_windows_moves_what_the_whole_read_moves(legs_: list[LegPieces], seed: int, max_bytes: int,
                                                          max_runs: int) -> None:
    """A staged read too large for one slot is read in windows of its stream (one slot, one
    StageRequest each): every window fits both limits, and the windows, gathered and
    scattered one after another, move exactly what the whole read moves."""
    remote = np.random.default_rng(seed).integers(0, 256, SIZE * 3, dtype=np.uint8)
    plan = staged_plan(legs_)
    wins = windows_of(plan, max_bytes, max_runs)
    assert sum(w.nbytes for w in wins) == plan.nbytes
    local = np.zeros(SIZE, np.uint8)
    for i, w in enumerate(wins):
        assert 0 < w.nbytes <= max_bytes
        if i and w.gather_runs < max_runs:  # (cut by bytes: none larger than the one before)
            assert w.nbytes <= wins[i - 1].nbytes or wins[i - 1].gather_runs == max_runs
        assert w.gather_runs <= max_runs
        assert len(w.remote_runs) == len(plan.remote_runs)  # (a leg is a remote rank: in place)
        stream = np.concatenate([remote[a - REMOTE:a - REMOTE + n]
                                 for runs in w.remote_runs for a, n in runs])
        assert len(stream) == w.nbytes
        assert int(w.scatter[:, 2].sum()) == w.nbytes
        for a, off, n in w.scatter:
            local[a - LOCAL:a - LOCAL + n] = stream[off:off + n]
    assert np.array_equal(local, run_staged(legs_, remote))


@settings(max_examples=100, deadline=None)
@given(legs(), st.integers(0, 2**31), st.integers(1, 1500),
       st.lists(st.integers(0, 2), min_size=8, max_size=8))
def test_windows_never_span_two_prefill_gpus(legs_: list[LegPieces], seed: int, max_bytes: int,
                                            gpus: list[int]) -> None:
    """A VRAM read whose prefill ranks sit on several GPUs (TP that differs across GPUs) is
    read in windows of one GPU each (no one slot can gather from two arenas): each window's
    runs come from legs of one group, and the windows still move what the whole read moves."""
    remote = np.random.default_rng(seed).integers(0, 256, SIZE * 3, dtype=np.uint8)
    plan = staged_plan(legs_)
    groups = gpus[:len(plan.remote_runs)]
    wins = windows_of(plan, max_bytes, 6, groups)
    assert sum(w.nbytes for w in wins) == plan.nbytes
    local = np.zeros(SIZE, np.uint8)
    for w in wins:
        assert len({groups[k] for k, runs in enumerate(w.remote_runs) if len(runs)}) == 1
        stream = np.concatenate([remote[a - REMOTE:a - REMOTE + n]
                                 for runs in w.remote_runs for a, n in runs])
        for a, off, n in w.scatter:
            local[a - LOCAL:a - LOCAL + n] = stream[off:off + n]
    assert np.array_equal(local, run_staged(legs_, remote))
    if len(set(g for g, r in zip(groups, plan.remote_runs, strict=True) if len(r))) == 1:
        assert len(wins) == len(windows_of(plan, max_bytes, 6))  # (one GPU: cut as before)


def test_windows_are_cut_every_max_bytes_or_where_max_runs_end() -> None:
    """Every window but the last is the largest (the prefill frees a reader's slot for its
    next window: that one must fit where the last was), unless its runs end first."""
    assert window_cuts(np.array([10, 10, 10]), 25, 9) == [0, 25, 30]
    assert window_cuts(np.array([300, 800, 900]), 1000, 9) == [0, 1000, 2000]
    assert window_cuts(np.array([10, 10, 10]), 100, 2) == [0, 20, 30]  # (two runs a window)
    assert window_cuts(np.array([50, 10]), 20, 9) == [0, 20, 40, 60]  # (a long run in pieces)
    assert window_cuts(np.array([5, 50]), 20, 1) == [0, 5, 25, 45, 55]  # (one run a window)
    assert window_cuts(np.array([], dtype=np.int64), 20, 9) == [0]


@settings(max_examples=200, deadline=None)
@given(legs())
def test_runs_are_merged_and_in_remote_order(legs_: list[LegPieces]) -> None:
    plan = staged_plan(legs_)
    for runs in plan.remote_runs:
        starts, ends = runs[:, 0], runs[:, 0] + runs[:, 1]
        assert (starts[1:] >= starts[:-1]).all()  # sorted by remote address
        assert not (starts[1:] == ends[:-1]).any()  # touching runs were merged
    assert plan.scatter[:, 2].sum() == plan.nbytes == sum(int(leg.length.sum()) for leg in legs_)
    assert plan.gather_runs <= sum(len(x.length) for x in legs_)


def test_a_slice_offset_off_by_one_head_moves_other_bytes() -> None:
    """The property above can fail: a plan one head off is caught by the byte check."""
    remote = np.random.default_rng(0).integers(0, 256, SIZE * 3, dtype=np.uint8)
    leg = LegPieces(np.array([LOCAL, LOCAL + 256]), np.array([REMOTE, REMOTE + 512]), np.array([256, 256]))
    good = run_staged([leg], remote)
    off = LegPieces(leg.local, leg.remote + 256, leg.length)
    assert not np.array_equal(run_staged([off], remote), good)


def test_pieces_of_follows_the_geometry() -> None:
    lg = np.array([[1000, 64, 256, 0], [1064, 32, 256, 0]], dtype=np.int64)
    rg = np.array([[9000, 64, 128, 0], [9064, 32, 128, 0]], dtype=np.int64)
    p = pieces_of(np.array([0 * 4 + 2, 1 * 4 + 3]), np.array([0 * 8 + 5, 1 * 8 + 7]), lg, rg, 4, 8)
    assert p.local.tolist() == [1000 + 2 * 256, 1064 + 3 * 256]
    assert p.remote.tolist() == [9000 + 5 * 128, 9064 + 7 * 128]
    assert p.length.tolist() == [64, 32]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_leg_pieces_are_the_pieces_of_the_direct_reads_descriptors(data: st.DataObject) -> None:
    """``leg_pieces`` (a staged read's pieces, computed from rows and blocks) equals
    ``pieces_of`` of the descriptor indices the direct read posts (``plan.leg_indices``),
    piece for piece and in order, for any rows, sub-positions and block pairs."""
    from kvxfer.sidecar.plan import leg_indices
    from kvxfer.sidecar.staging import leg_pieces

    local_nb, remote_nb = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    n_rows = data.draw(st.integers(1, 6))
    geo = st.tuples(st.integers(0, 1 << 30), st.integers(1, 4096), st.integers(1, 1 << 16), st.just(0))
    lg = np.array(data.draw(st.lists(geo, min_size=n_rows, max_size=n_rows)), dtype=np.int64)
    rg = np.array(data.draw(st.lists(geo, min_size=n_rows, max_size=n_rows)), dtype=np.int64)
    subs = data.draw(st.integers(1, 3))
    row_ids = st.lists(st.integers(0, n_rows - 1), min_size=0, max_size=n_rows)
    rows = [np.array(data.draw(row_ids), dtype=np.int64) for _ in range(subs)]
    n_local, n_remote = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    lb = np.array(data.draw(st.lists(st.integers(0, local_nb - 1), min_size=n_local, max_size=n_local)))
    rb = np.array(data.draw(st.lists(st.integers(0, remote_nb - 1), min_size=n_remote, max_size=n_remote)))
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n_local - 1), st.integers(0, n_remote - 1),
                                         st.integers(0, subs - 1)), max_size=12))
    li, ri, _ = leg_indices(rows, lg, pairs, lb, rb, local_nb, remote_nb)
    want = pieces_of(li, ri, lg, rg, local_nb, remote_nb)
    got = leg_pieces(rows, lg, rg, pairs, lb, rb)
    assert got.local.tolist() == want.local.tolist()
    assert got.remote.tolist() == want.remote.tolist()
    assert got.length.tolist() == want.length.tolist()


def test_worth_staging() -> None:
    many_small = staged_plan([LegPieces(np.arange(1000, dtype=np.int64) * 8192,
                                        np.arange(1000, dtype=np.int64) * 16384,
                                        np.full(1000, 4096, dtype=np.int64))])
    assert many_small.direct_descs == 1000
    assert worth_staging(many_small, 32 << 10)
    assert not worth_staging(many_small, 4 << 10)  # 4 KiB average is not under 4 KiB
    assert not worth_staging(many_small, 0)  # off
    contiguous = staged_plan([LegPieces(np.arange(1000, dtype=np.int64) * 4096,
                                        np.arange(1000, dtype=np.int64) * 4096,
                                        np.full(1000, 4096, dtype=np.int64))])
    assert contiguous.direct_descs == 1
    assert not worth_staging(contiguous, 32 << 10)


def test_small_shares_stage_more_readily_the_more_ranks_read_them() -> None:
    """Each decode rank's direct read pays a read's fixed cost; one staged request serves them
    all: a share of at most SMALL_SHARE is staged below ranks x the size, a larger one not."""
    def plan(n: int, size: int) -> StagedPlan:
        at = np.arange(n, dtype=np.int64) * size
        return staged_plan([LegPieces(at * 2, at * 3, np.full(n, size, dtype=np.int64))])

    eight_to_eight = plan(256, 8 << 10)  # 2 MiB of 8 KiB: an NHD rank's share at 8 -> 8
    assert eight_to_eight.nbytes <= SMALL_SHARE
    assert not worth_staging(eight_to_eight, 8 << 10)  # (8 KiB is not under 8)
    assert worth_staging(eight_to_eight, 8 << 10, ranks=8)
    assert worth_staging(eight_to_eight, 8 << 10, ranks=2)
    two_to_two = plan(256, 32 << 10)  # 8 MiB of 32 KiB: too large a share
    assert not worth_staging(two_to_two, 8 << 10, ranks=2)
    latent = plan(1024, 16 << 10)  # MLA: every rank reads the whole 16 MiB latent
    assert not worth_staging(latent, 8 << 10, ranks=8)
    assert not worth_staging(eight_to_eight, 0, ranks=8)  # off stays off


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 64), st.integers(0, 3)), min_size=1, max_size=4),
       st.sets(st.integers(-2, 9), max_size=6),
       st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 300)), min_size=1, max_size=8))
def test_runs_inside_is_containment_in_held_blocks(regs: list[tuple[int, int, int]], blocks: set[int],
                                                   runs: list[tuple[int, int]]) -> None:
    nb = 8
    regions = np.array([(base * 100, blen, blen + gap * 16) for base, blen, gap in regs], dtype=np.int64)
    mask = np.zeros(4000, dtype=bool)
    for a, blen, stride in regions:
        for b in blocks:
            if 0 <= b < nb:
                mask[a + b * stride:a + b * stride + blen] = True
    starts, ends = held_intervals(regions, np.array(sorted(blocks), dtype=np.int64), nb)
    got = runs_inside(np.array(runs, dtype=np.int64), starts, ends)
    want = next((i for i, (a, n) in enumerate(runs) if n == 0 or not mask[a:a + n].all()), -1)
    assert got == want


def test_a_run_whose_end_would_wrap_around_is_not_inside() -> None:
    """A peer's ``StageRequest`` names its runs: one at 2**63 - 8 of 16 bytes summed to a negative
    end, passed as inside the held blocks, and the prefill's copy read from there (the sidecar
    died of SIGSEGV; found by a review)."""
    starts, ends = np.array([4096], dtype=np.int64), np.array([8192], dtype=np.int64)
    assert runs_inside(np.array([[4096, 4096]], dtype=np.int64), starts, ends) == -1
    for run in ([2**63 - 8, 16], [4096, 2**63 - 1], [-2**63, 16], [8000, 2**62]):
        assert runs_inside(np.array([run], dtype=np.int64), starts, ends) == 0, run


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * SLOT_ALIGN), st.integers(0, 30)), max_size=60))
def test_slots_never_overlap(ops: list[tuple[bool, int, int]]) -> None:
    book = SlotBook(16 * SLOT_ALIGN)
    live: dict[int, tuple[int, int]] = {}
    for i, (alloc, n, pick) in enumerate(ops):
        if alloc or not live:
            off = book.alloc(n, i, expires=float(i))
            if off is not None:
                size = -(-n // SLOT_ALIGN) * SLOT_ALIGN
                assert off % SLOT_ALIGN == 0
                assert off + size <= book.size
                assert all(off + size <= o or o + s <= off for o, s in live.values())
                live[i] = (off, size)
            else:  # no room: no gap of that size anywhere
                size = -(-n // SLOT_ALIGN) * SLOT_ALIGN
                edges = sorted(live.values())
                ends = [(0, 0), *edges]
                gaps = [b[0] - (a[0] + a[1]) for a, b in zip(ends, [*edges, (book.size, 0)], strict=True)]
                assert max(gaps) < size
        else:
            key = sorted(live)[pick % len(live)]
            assert book.free(key)
            assert not book.free(key)
            del live[key]
    assert book.used == sum(s for _, s in live.values())
    book.expire(float(len(ops)))
    assert len(book) == 0
    assert book.alloc(book.size, "all", 0.0) == 0
    assert book.alloc(1, "all", 0.0) is None  # one slot per key


@settings(deadline=None)  # (its first example imports the decode's staging side: ~0.3 s under load)
@given(st.lists(st.integers(1, 40), max_size=12), st.integers(1, 60))
def test_a_batch_is_cut_into_stage_requests_that_fit(sizes: list[int], limit: int) -> None:
    """``staged_reads.parts``: members in order, every part's runs within the limit unless
    one member alone exceeds it, and no part that could have taken the next member's runs."""
    from kvxfer.protocol import StageRank
    from kvxfer.sidecar.staged_reads import _Member, parts

    members = [_Member(None, type("P", (), {"ranks": [StageRank(rank=0, pp_rank=0, runs=b"r" * 16 * n)]})(),
                       None, 0.0, None) for n in sizes]  # type: ignore[arg-type]
    got = parts(members, 16 * limit)
    assert [m for p in got for m in p] == members
    for i, part in enumerate(got):
        size = sum(m.runs_bytes for m in part)
        assert size <= 16 * limit or len(part) == 1
        if i + 1 < len(got):
            assert size + got[i + 1][0].runs_bytes > 16 * limit


def test_the_prefill_and_decode_halves_of_a_sidecar_share_one_book_of_arena_slots(tmp_path: object) -> None:
    """One sidecar serves both roles by default (a node with a prefill and a decode engine):
    each half kept its own book of the one arena, so a prefill's gather for a peer and this
    sidecar's own read could be given the same bytes at once (wrong KV either way; found by a
    review). Both halves now take their slots from one book."""
    import os

    from kvxfer.config import Config
    from kvxfer.sidecar.app import Sidecar

    os.chmod(tmp_path, 0o700)
    sidecar = Sidecar(Config(engine_socket=f"ipc://{tmp_path}/e.sock", insecure=True, handshake_port=0,
                             metrics_port=0, control_target=f"unix://{tmp_path}/c.ctl"))
    try:
        prefill, decode = sidecar.peer_server.stager.books, sidecar.receiver.staging.books
        assert prefill is decode
        sidecar.nixl.spans[-1] = (1 << 30, 4 * SLOT_ALIGN)  # (an arena, as the port reports it)
        a = prefill.get(-1).alloc(SLOT_ALIGN, ("peer", "p", "r1", ("0/0",), -1), 1e9)
        b = decode.get(-1).alloc(SLOT_ALIGN, "r2#0", 1e9)
        assert a is not None
        assert b is not None
        assert a != b
    finally:  # (never started: its sockets closed here)
        sidecar.ctx.destroy(linger=0)
        sidecar.dial_ctx.destroy(linger=0)
