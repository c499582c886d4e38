"""``kvxfer.pairing.pair_sizes`` with the sidecar's ``BlockPairing``: when the two sides' blocks
hold different numbers of tokens, every token the decode loads lands at its own position
(property-tested: sizes, the decode's cached prefix, the prompt, block ids all drawn); and
through the sidecar's byte plans (``plan_rank``) on simulated blocks whose every unit names
its token, head and K/V part: NHD/HND on either side, K/V split or fused, MLA, TP sizes that
differ (from a review of the change)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.pairing import pair_sizes
from kvxfer.protocol import KVLayout
from kvxfer.testing.engine import make_layout
from kvxfer.topology import BlockPairing, _offset, block_pairing, plan_rank, rank_heads


@st.composite
def loads(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], list[int]]:
    small = draw(st.sampled_from([1, 2, 4, 16, 3, 5]))
    ratio = draw(st.integers(2, 5))
    local_size, remote_size = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    big = max(local_size, remote_size)
    end = draw(st.integers(1, 12 * big))
    first = big * draw(st.integers(0, (end - 1) // big))  # (a prefix on both sides' boundaries)
    lookahead = draw(st.integers(0, 2))  # (vLLM may give the decode more blocks than it loads)
    local = draw(st.permutations(range(1, 200)))[: -(-end // local_size) - first // local_size + lookahead]
    remote = draw(st.permutations(range(300, 500)))[: -(-end // remote_size)]
    return local_size, remote_size, first, end, local, remote


@settings(max_examples=300, deadline=None)
@given(loads())
def test_every_loaded_token_pairs_with_itself(case: tuple[int, int, int, int, list[int], list[int]]) -> None:
    local_size, remote_size, first, end, local, remote = case
    pairs = pair_sizes(local, remote, first, end, local_size, remote_size)
    small = min(local_size, remote_size)
    pairing = BlockPairing(max(local_size, remote_size) // small, local_size > remote_size)
    moved: dict[tuple[int, int], tuple[int, int]] = {}  # (decode block, offset) <- (prefill block, offset)
    for li, ri, q in pairing.pairs(len(pairs.local), len(pairs.remote)):
        for o in range(small):  # sub-position q of the larger block holds its q-th run of `small` tokens
            lo, ro = (q * small + o, o) if pairing.local_larger else (o, q * small + o)
            moved[(pairs.local[li], lo)] = (pairs.remote[ri], ro)
    for t in range(first, end):
        here = (local[t // local_size - first // local_size], t % local_size)
        assert moved.get(here) == (remote[t // remote_size], t % remote_size), f"token {t}"


def test_a_prefix_ending_inside_a_prefill_block_is_refused() -> None:
    with pytest.raises(ValueError, match="inside a prefill block"):
        pair_sizes([1, 2, 3], [10, 11], 16, 40, 16, 32)


@pytest.mark.parametrize(("local", "remote", "local_size", "remote_size"), [
    ([1], [10, 11], 16, 32),  # (40 tokens: 3 decode blocks of 16)
    ([1, 2], [10], 32, 16),  # (40 tokens: 3 prefill blocks of 16)
])
def test_too_few_blocks_are_refused(local: list[int], remote: list[int], local_size: int,
                                    remote_size: int) -> None:
    with pytest.raises(ValueError, match="blocks here"):
        pair_sizes(local, remote, 0, 40, local_size, remote_size)


def test_sizes_neither_divides_are_refused() -> None:
    with pytest.raises(ValueError, match="neither"):
        pair_sizes([1], [2], 0, 10, 16, 24)


# ------------------------------------------------------------ through the sidecar's byte plans

HD = 4  # head_dim, float16: one 8-byte word per (token, head) unit


def _fill(lay: KVLayout, token_of: Callable[[int, int], int], parts: int) -> list[np.ndarray]:
    """Blocks of one region per K/V part: every word says (token, global head, part, word)."""
    out = []
    h0 = rank_heads(lay).start
    for part in range(parts):
        arr = np.full((64, lay.region_block_len // 8), -1, dtype=np.int64)
        for b in range(64):
            for t in range(lay.block_size):
                for h in range(lay.local_kv_heads):
                    off = _offset(lay, t, h) // 8
                    for w in range(lay.unit_bytes // 8):
                        arr[b, off + w] = token_of(b, t) * 100000 + (h0 + h) * 100 + part * 10 + w
        out.append(arr)
    return out


def _layout(bs: int, kind: str, heads: int, tp: int, rank: int, head_layout: str) -> KVLayout:
    lay = make_layout(layers=1, num_blocks=64, block_size=bs, heads=heads, head_dim=HD, dtype="float16",
                      tp_size=tp, tp_rank=rank, mla=kind == "mla", head_layout=head_layout)
    return msgspec.structs.replace(lay, kv_parts=1, fused="kv_content") if kind == "kv_content" else lay


@st.composite
def planned(draw: st.DrawFn) -> tuple[int, int, str, int, int, int, str, str, int, int]:
    small, ratio = draw(st.sampled_from([1, 2, 4])), draw(st.integers(2, 3))
    ls, rs = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    kind = draw(st.sampled_from(["split", "kv_content", "mla"]))
    lhl, rhl = ((draw(st.sampled_from(["NHD", "HND"])), draw(st.sampled_from(["NHD", "HND"])))
                if kind == "split" else ("HND", "HND"))
    big = max(ls, rs)
    end = draw(st.integers(1, 5 * big))
    first = big * draw(st.integers(0, (end - 1) // big))
    return (ls, rs, kind, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 2, 4])), lhl, rhl, first, end)


@settings(max_examples=60, deadline=None)
@given(planned())
def test_every_token_and_head_lands_at_its_own_place_through_the_byte_plans(
        case: tuple[int, int, str, int, int, int, str, str, int, int]) -> None:
    ls, rs, kind, heads, ltp, rtp, lhl, rhl, first, end = case
    parts = 2 if kind == "split" else 1
    remote_ids = list(range(5, 5 + -(-end // rs)))  # block id b holds tokens from (b - 5) * rs
    local_ids = list(range(30, 30 + -(-end // ls) - first // ls))
    pairs = pair_sizes(local_ids, remote_ids, first, end, ls, rs)
    for lrank in range(ltp):
        local, remote = _layout(ls, kind, heads, ltp, lrank, lhl), _layout(rs, kind, heads, rtp, 0, rhl)
        pairing = block_pairing(local, remote)
        def token_of(b: int, t: int) -> int:
            return (b - 5) * rs + t if b >= 5 else -1

        theirs = {r: _fill(_layout(rs, kind, heads, rtp, r, rhl), token_of, parts) for r in range(rtp)}
        mine = [a.view(np.uint8).copy() for a in _fill(local, lambda b, t: -7, parts)]
        for plan in plan_rank(local, remote):
            for li, ri, q in pairing.pairs(len(pairs.local), len(pairs.remote)):
                for part in range(parts):
                    src = theirs[plan.remote_rank][part].view(np.uint8)
                    for s in plan.segments[q]:
                        mine[part][pairs.local[li], s.local_off:s.local_off + s.length] = \
                            src[pairs.remote[ri], s.remote_off:s.remote_off + s.length]
        h0 = rank_heads(local).start
        for tok in range(first, end):
            b, t = local_ids[tok // ls - first // ls], tok % ls
            for part in range(parts):
                words = mine[part].view(np.int64)
                for h in range(local.local_kv_heads):
                    off = _offset(local, t, h) // 8
                    for w in range(local.unit_bytes // 8):
                        want = tok * 100000 + (h0 + h) * 100 + part * 10 + w
                        assert words[b, off + w] == want, (tok, h, part, w)
