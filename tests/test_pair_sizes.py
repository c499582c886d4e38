"""``kvxfer.pairing.pair_sizes`` with the sidecar's ``BlockPairing``: when the two sides' blocks
hold different numbers of tokens, every token the decode loads lands at its own position
(property-tested: sizes, the decode's cached prefix, the prompt, block ids all drawn)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.pairing import pair_sizes
from kvxfer.topology import BlockPairing


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
