"""Property tests of the TP mapping: simulate every planned copy byte by byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.protocol import KVLayout
from kvxfer.topology import (
    Incompatible,
    RankPlan,
    Segment,
    assign_heads,
    block_pairing,
    check_compatible,
    check_plan,
    plan_rank,
    rank_heads,
)

TPS = [1, 2, 4, 8]


def layout(heads: int, tp: int, rank: int, block: int, hd: int, dtype: str, hl: str, mla: bool,
           parts: int = 2, fused: str = "") -> KVLayout:
    local = 1 if mla else (heads // tp if heads >= tp else 1)
    if fused:
        parts = 1
    return KVLayout(num_layers=1, num_blocks=64, block_size=block, num_kv_heads=heads,
                    local_kv_heads=local, head_dim=hd, dtype=dtype, kv_parts=1 if mla else parts,
                    mla=mla, head_layout=hl, tp_rank=rank, tp_size=tp,  # type: ignore[arg-type]
                    fused="" if mla else fused)  # type: ignore[arg-type]


def block_len(lay: KVLayout) -> int:
    """The block length computed independently of the code under test."""
    kv = 2 if lay.fused else 1
    return lay.block_size * lay.local_kv_heads * lay.head_dim * lay.itemsize * kv


def fill(lay: KVLayout, n_blocks: int) -> np.ndarray:
    """Cells (one per byte) coding (token position, global head, byte in head); never 0.

    A fused block holds K then V in each (token, head) run; a kv_per_head block holds each
    head's tokens in an order only the engine knows (here reversed, to catch token slicing).
    """
    hd = lay.head_dim * lay.itemsize * (2 if lay.fused else 1)
    out = np.zeros((n_blocks, block_len(lay)), dtype=np.int64)
    h0 = rank_heads(lay).start
    for b in range(n_blocks):
        for t in range(lay.block_size):
            for hl in range(lay.local_kv_heads):
                slot = lay.block_size - 1 - t if lay.fused == "kv_per_head" else t
                off = ((hl * lay.block_size + slot) if lay.head_layout == "HND"
                       else (slot * lay.local_kv_heads + hl)) * hd
                pos = b * lay.block_size + t
                out[b, off:off + hd] = (pos * 64 + h0 + hl) * 1000 + np.arange(hd) + 1
    return out


@st.composite
def topologies(draw: st.DrawFn) -> tuple[KVLayout, int, KVLayout, int]:
    mla = draw(st.booleans())
    fused = "" if mla else draw(st.sampled_from(["", "kv_content", "kv_per_head"]))
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    tp_r, tp_l = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    hd = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["uint8", "float16"]))
    small = draw(st.sampled_from([1, 2, 4]))
    ratio = 1 if fused == "kv_per_head" else draw(st.sampled_from([1, 2, 4]))
    bl, br = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    rl = draw(st.integers(0, tp_l - 1))
    hls = ["HND"] if fused == "kv_per_head" else ["NHD", "HND"]
    loc = layout(heads, tp_l, rl, bl, hd, dtype, draw(st.sampled_from(hls)), mla, fused=fused)
    rem = layout(heads, tp_r, 0, br, hd, dtype, draw(st.sampled_from(hls)), mla, fused=fused)
    return loc, tp_l, rem, draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None)
@given(topologies())
def test_every_destination_byte_written_once_from_the_right_source(topo) -> None:  # type: ignore[no-untyped-def]
    loc, _, rem, big_blocks = topo
    pairing = block_pairing(loc, rem)
    n_local = big_blocks if pairing.local_larger else big_blocks * pairing.ratio
    n_remote = big_blocks * pairing.ratio if pairing.local_larger else big_blocks
    if pairing.ratio == 1:
        n_local = n_remote = big_blocks
    sources = {p: fill(layout(rem.num_kv_heads, rem.tp_size, p, rem.block_size, rem.head_dim,
                              rem.dtype, rem.head_layout, rem.mla, fused=rem.fused), n_remote)
               for p in range(rem.tp_size)}
    dst = np.zeros((n_local, block_len(loc)), dtype=np.int64)
    writes = np.zeros_like(dst)
    plans = plan_rank(loc, rem)
    for li, ri, q in pairing.pairs(n_local, n_remote):
        for plan in plans:
            for s in plan.segments[q]:
                dst[li, s.local_off:s.local_off + s.length] = (
                    sources[plan.remote_rank][ri, s.remote_off:s.remote_off + s.length])
                writes[li, s.local_off:s.local_off + s.length] += 1
    assert (writes == 1).all()
    assert np.array_equal(dst, fill(loc, n_local))


@settings(max_examples=100, deadline=None)
@given(topologies())
def test_each_local_head_comes_from_one_holder(topo) -> None:  # type: ignore[no-untyped-def]
    loc, _, rem, _ = topo
    assigned = assign_heads(loc, rem)
    heads = [h for hs in assigned.values() for h in hs]
    assert sorted(heads) == list(rank_heads(loc))
    for p, hs in assigned.items():
        assert all(h in rank_heads(rem, p) for h in hs)


def test_equal_layouts_copy_whole_blocks_in_one_descriptor() -> None:
    a = layout(8, 2, 1, 16, 128, "bfloat16", "NHD", False)
    (plan,) = plan_rank(a, a)
    assert plan.remote_rank == 1
    assert plan.segments == (((plan.segments[0][0]),),)
    assert plan.segments[0][0].length == block_len(a)


@pytest.mark.parametrize(("hl", "runs"), [("HND", 1), ("NHD", 16)])
def test_hnd_makes_head_slices_contiguous(hl: str, runs: int) -> None:
    p = layout(8, 2, 0, 16, 128, "bfloat16", hl, False)
    d = layout(8, 4, 1, 16, 128, "bfloat16", hl, False)
    (plan,) = plan_rank(d, p)
    assert plan.remote_rank == 0
    assert len(plan.segments[0]) == runs


def test_replicated_prefill_heads_are_spread_over_readers() -> None:
    p = layout(2, 8, 0, 16, 64, "bfloat16", "HND", False)  # 4 replicas of each head
    picks = {d: assign_heads(layout(2, 2, d, 16, 64, "bfloat16", "HND", False), p) for d in range(2)}
    assert picks == {0: {0: [0]}, 1: {5: [1]}}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"head_dim": 64}, "head_dim differs"),
        ({"dtype": "float16"}, "dtype differs"),
        ({"num_layers": 3}, "layers differs"),
        ({"block_size": 24}, "not multiples"),
    ],
)
def test_incompatible_pairs_are_refused(change: dict, reason: str) -> None:
    import msgspec

    a = layout(8, 2, 0, 16, 128, "bfloat16", "NHD", False)
    b = msgspec.structs.replace(a, **change)
    with pytest.raises(Incompatible, match=reason):
        check_compatible(a, b)


@pytest.mark.parametrize("fused", ["kv_content", "kv_per_head"])
def test_fused_blocks_are_read_whole(fused: str) -> None:
    """The bug that passed every dummy-weight test: a fused block read as half its size."""
    a = layout(8, 2, 0, 16, 128, "bfloat16", "HND", False, fused=fused)
    (plan,) = plan_rank(a, a)
    assert sum(s.length for s in plan.segments[0]) == 16 * 4 * 128 * 2 * 2  # K and V


def test_fused_layouts_are_refused_between_kinds_and_without_a_kind() -> None:
    a = layout(8, 2, 0, 16, 128, "bfloat16", "HND", False, fused="kv_content")
    b = layout(8, 2, 0, 16, 128, "bfloat16", "HND", False, fused="kv_per_head")
    with pytest.raises(Incompatible, match="fused differs"):
        check_compatible(a, b)
    with pytest.raises(Incompatible, match="must say how K and V are fused"):
        check_compatible(layout(8, 2, 0, 16, 128, "bfloat16", "HND", False, parts=1), a)
    with pytest.raises(Incompatible, match="same block size"):
        check_compatible(b, layout(8, 2, 0, 32, 128, "bfloat16", "HND", False, fused="kv_per_head"))


def _half_block_plan(lay: KVLayout) -> list[RankPlan]:
    return [RankPlan(lay.tp_rank, ((Segment(0, 0, block_len(lay) // 2),),))]


@pytest.mark.parametrize(
    ("plans", "reason"),
    [
        (_half_block_plan, "covers 4096 of 8192 bytes"),
        (lambda lay: [RankPlan(0, ((Segment(0, 0, 8192), Segment(4096, 0, 4096)),))], "overlap"),
        (lambda lay: [RankPlan(0, ((Segment(0, 0, 4096), Segment(4608, 4608, 3584)),))], "gap"),
        (lambda lay: [RankPlan(0, ((Segment(0, 8, 8192),),))], "outside a 8192-byte remote block"),
        (lambda lay: [RankPlan(0, ((Segment(0, 0, 8200),),))], "outside a 8192-byte local block"),
        (lambda lay: [RankPlan(3, ((Segment(0, 0, 8192),),))], "remote rank 3"),
    ],
)
def test_a_wrong_plan_is_refused(plans, reason: str) -> None:  # type: ignore[no-untyped-def]
    lay = layout(2, 1, 0, 16, 64, "bfloat16", "NHD", False, fused="kv_content")
    assert block_len(lay) == 8192
    check_plan(lay, lay, plan_rank(lay, lay))  # the real plan passes
    with pytest.raises(Incompatible, match=reason):
        check_plan(lay, lay, plans(lay))


def test_the_sidecar_refuses_a_plan_that_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_rank never hands out a plan that fails coverage, whatever built it."""
    import kvxfer.topology as topo

    other = layout(4, 1, 0, 16, 32, "float16", "HND", False, fused="kv_content")
    monkeypatch.setattr(topo, "_build_plan", lambda local, remote: tuple(_half_block_plan(local)))
    topo._plan_rank.cache_clear()
    try:
        with pytest.raises(Incompatible, match="covers 4096 of 8192"):
            plan_rank(other, other)
    finally:
        topo._plan_rank.cache_clear()
