"""Property tests of the TP mapping: simulate every planned copy byte by byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.protocol import KVLayout
from kvxfer.topology import (
    Incompatible,
    assign_heads,
    block_pairing,
    check_compatible,
    plan_rank,
    rank_heads,
)

TPS = [1, 2, 4, 8]


def layout(heads: int, tp: int, rank: int, block: int, hd: int, dtype: str, hl: str, mla: bool,
           parts: int = 2) -> KVLayout:
    local = 1 if mla else (heads // tp if heads >= tp else 1)
    return KVLayout(num_layers=1, num_blocks=64, block_size=block, num_kv_heads=heads,
                    local_kv_heads=local, head_dim=hd, dtype=dtype, kv_parts=1 if mla else parts,
                    mla=mla, head_layout=hl, tp_rank=rank, tp_size=tp)  # type: ignore[arg-type]


def block_len(lay: KVLayout) -> int:
    return lay.block_size * lay.local_kv_heads * lay.head_dim * lay.itemsize


def fill(lay: KVLayout, n_blocks: int) -> np.ndarray:
    """Cells (one per byte) coding (token position, global head, byte in head); never 0."""
    hd = lay.head_dim * lay.itemsize
    out = np.zeros((n_blocks, block_len(lay)), dtype=np.int64)
    h0 = rank_heads(lay).start
    for b in range(n_blocks):
        for t in range(lay.block_size):
            for hl in range(lay.local_kv_heads):
                off = ((hl * lay.block_size + t) if lay.head_layout == "HND"
                       else (t * lay.local_kv_heads + hl)) * hd
                pos = b * lay.block_size + t
                out[b, off:off + hd] = (pos * 64 + h0 + hl) * 1000 + np.arange(hd) + 1
    return out


@st.composite
def topologies(draw: st.DrawFn) -> tuple[KVLayout, int, KVLayout, int]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    tp_r, tp_l = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    hd = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["uint8", "float16"]))
    small = draw(st.sampled_from([1, 2, 4]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    bl, br = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    rl = draw(st.integers(0, tp_l - 1))
    loc = layout(heads, tp_l, rl, bl, hd, dtype, draw(st.sampled_from(["NHD", "HND"])), mla)
    rem = layout(heads, tp_r, 0, br, hd, dtype, draw(st.sampled_from(["NHD", "HND"])), mla)
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
                              rem.dtype, rem.head_layout, rem.mla), n_remote)
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
        ({"num_layers": 3}, "num_layers differs"),
        ({"block_size": 24}, "not multiples"),
    ],
)
def test_incompatible_pairs_are_refused(change: dict, reason: str) -> None:
    import msgspec

    a = layout(8, 2, 0, 16, 128, "bfloat16", "NHD", False)
    b = msgspec.structs.replace(a, **change)
    with pytest.raises(Incompatible, match=reason):
        check_compatible(a, b)


def test_fused_blocks_need_identical_shapes() -> None:
    a = layout(8, 2, 0, 16, 128, "bfloat16", "NHD", False, parts=1)
    b = layout(8, 4, 0, 16, 128, "bfloat16", "NHD", False, parts=1)
    check_compatible(a, a)
    with pytest.raises(Incompatible, match="fused"):
        check_compatible(a, b)
