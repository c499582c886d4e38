"""Push mode's pure half (kvxfer.sidecar.layer_stream): the prefill's layer book, the decode's
read ranges and plans cut to layers. Property-tested."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import RequestError
from kvxfer.protocol import KVLayout
from kvxfer.sidecar.layer_stream import (
    WATCHERS_MAX,
    LayerBook,
    read_ranges,
    ready_layers,
    remote_suffix,
    restrict,
)
from kvxfer.sidecar.stream_feed import FIRST_SEEN
from kvxfer.topology import plan_stages


@given(st.integers(0, 64), st.integers(0, 64))
def test_read_ranges_cover_exactly_and_are_aligned(have: int, extra: int) -> None:
    ready = have + extra
    ranges = read_ranges(have, ready)
    covered = [layer for a, b in ranges for layer in range(a, b)]
    assert covered == list(range(have, ready))
    for a, b in ranges:
        size = b - a
        assert size & (size - 1) == 0  # a power of two
        assert a % size == 0  # aligned to its size


def test_read_ranges_of_a_request_are_few() -> None:
    """Whatever the moments layers became ready, the ranges one request uses are among the
    aligned runs of 32 layers: at most 63 distinct ones."""
    seen = set()
    for cuts in itertools.combinations(range(1, 32), 3):
        points = [0, *cuts, 32]
        for a, b in itertools.pairwise(points):
            seen.update(read_ranges(a, b))
    assert len(seen) <= 63
    assert read_ranges(0, 32) == [(0, 32)]


def test_ready_layers_waits_for_every_rank_of_a_stage() -> None:
    stages = {0: (0, 4), 1: (4, 4)}
    assert ready_layers(stages, 2, {}) == 0
    assert ready_layers(stages, 2, {(0, 0): 4}) == 0  # tp 1 of stage 0 has computed nothing
    assert ready_layers(stages, 2, {(0, 0): 4, (0, 1): 2}) == 2
    assert ready_layers(stages, 2, {(0, 0): 4, (0, 1): 4, (1, 0): 3, (1, 1): 9}) == 7
    assert ready_layers(stages, 2, {(0, 0): 4, (0, 1): 4, (1, 0): 4, (1, 1): 4}) == 8
    assert ready_layers({1: (4, 4)}, 1, {(1, 0): 4}) == 0  # (stage 0 missing)


def test_layer_book_answers_watchers_when_layers_pass_them() -> None:
    book = LayerBook()
    key = ("p", "t1")
    assert book.report(key, 0, 1, 3) == []  # before its Hold: kept
    book.start(key, {0: (0, 8)}, 2)
    assert book.get(key).ready == 0  # rank 0 has reported nothing yet
    w1, w2 = object(), object()
    assert book.watch(key, 0, w1) is False
    assert book.watch(key, 2, w2) is False
    assert book.report(key, 0, 0, 1) == [w1]  # ready 1: w1 (has 0) sees more, w2 (has 2) not
    assert book.report(key, 0, 0, 1) == []  # (the same count again changes nothing)
    assert book.report(key, 0, 0, 5) == [w2]  # ready min(5, 3) = 3
    assert book.watch(key, 1, object()) is True  # 3 > 1: answered at once
    w3 = object()
    assert book.watch(key, 3, w3) is False
    assert book.unwatch(key, w3) is True
    assert book.unwatch(key, w3) is False
    w4 = object()
    book.watch(key, 3, w4)
    assert book.end(key) == [w4]
    assert key not in book


def test_watchers_of_one_request_are_bounded() -> None:
    """A peer that sends watch after watch for one request parks at most WATCHERS_MAX of them;
    the rest are answered at once (with what is ready), never kept."""
    book = LayerBook()
    book.start(("p", "t"), {0: (0, 4)}, 1)
    parked = [book.watch(("p", "t"), 0, object()) for _ in range(WATCHERS_MAX + 10)]
    assert parked.count(False) == WATCHERS_MAX
    assert len(book.end(("p", "t"))) == WATCHERS_MAX


def test_a_finished_request_answers_at_once() -> None:
    book = LayerBook()
    book.start(("p", "t"), {0: (0, 2)}, 1)
    book.report(("p", "t"), 0, 0, 2)
    assert book.watch(("p", "t"), 2, object()) is True


def test_a_readers_first_chunk_watch_is_answered_at_once_with_nothing_computed() -> None:
    """A reader's first ChunkWatch says it saw version -1 (``stream_feed.FIRST_SEEN``): answered
    at once, no layer computed (it pairs and plans the prefill's blocks meanwhile); its next,
    with the version it saw, waits for a change; the same watch as a LayerWatch waits too."""
    book = LayerBook()
    book.start(("p", "t"), {0: (0, 8)}, 1)
    assert book.watch(("p", "t"), 0, object(), FIRST_SEEN) is True
    assert book.watch(("p", "t"), 0, object(), 0) is False
    assert book.watch(("p", "t"), 0, object()) is False


def _layout(tp: int, rank: int, layers: int, pp: int = 0, first: int = 0, total: int = 0,
            parts: int = 2, heads: int = 4) -> KVLayout:
    heads = 1 if parts == 1 else heads
    return KVLayout(num_layers=layers, num_blocks=16, block_size=4, num_kv_heads=heads,
                    local_kv_heads=1 if parts == 1 else max(1, heads // tp), head_dim=8, dtype="float16",
                    kv_parts=parts,
                    tp_rank=rank, tp_size=tp, pp_rank=pp, pp_size=2 if total else 1, first_layer=first,
                    total_layers=total, mla=parts == 1, head_layout="HND")


def _pairs(plans: list, n_local: int) -> set[tuple[int, int, int]]:
    out = set()
    for plan in plans:
        lsl, rsl = plan.region_slices(n_local)
        for li, ri in zip(lsl, rsl, strict=True):
            out.add((plan.remote_pp, plan.remote_rank, li * 1000 + ri))
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)]), st.sampled_from([1, 2]),
       st.booleans(), st.lists(st.integers(1, 11), min_size=0, max_size=4))
def test_restricted_plans_partition_the_plan(tps: tuple[int, int], parts: int, pipeline: bool,
                                             cuts: list[int]) -> None:
    """Cut at any layers, the restricted plans together pair exactly the regions the whole
    plan pairs, each once, and each cut only the regions of its layers."""
    p_tp, d_tp = tps
    layers = 12
    local = _layout(d_tp, 0, layers, parts=parts)
    if pipeline:
        remote = {0: _layout(p_tp, 0, 5, pp=0, first=0, total=layers, parts=parts),
                  1: _layout(p_tp, 0, 7, pp=1, first=5, total=layers, parts=parts)}
    else:
        remote = {0: _layout(p_tp, 0, layers, parts=parts)}
    plans = plan_stages(local, remote)
    n_local = local.num_regions
    whole = _pairs(plans, n_local)
    points = sorted({0, layers, *cuts})
    seen: list[tuple[int, int, int]] = []
    for a, b in itertools.pairwise(points):
        for ra, rb in read_ranges(a, b):
            part = restrict(plans, (ra, rb), remote, n_local, last=rb == layers)
            got = _pairs(part, n_local)
            for _pp, _rank, code in got:
                li = code // 1000
                assert ra <= li // parts < rb  # only regions of its layers
            seen += list(got)
    assert len(seen) == len(set(seen))
    assert set(seen) == whole


def test_remote_suffix_on_a_partial_prefix_hit() -> None:
    assert remote_suffix([7, 8, 9, 10], 2, True) == [9, 10]
    assert remote_suffix([7, 8, 9, 10], 4, True) == [7, 8, 9, 10]
    assert remote_suffix([7, 8, 9, 10], 2, False) == [7, 8, 9, 10]


def test_a_read_cut_to_some_layers_counts_only_their_regions_toward_the_inline_cap() -> None:
    """Push mode's last read of one layer is small and posted by the loop itself; its request
    (every layer) is not: ``read_bound`` counts what the plans name (kvxfer.sidecar.nixl_port)."""
    import dataclasses

    from kvxfer.protocol import RankInfo, RemoteRegion
    from kvxfer.sidecar.nixl_port import read_bound
    from kvxfer.sidecar.plan import ReadSpec
    from kvxfer.testing.engine import make_layout
    from kvxfer.topology import BlockPairing, RankPlan

    lay = make_layout(layers=4, num_blocks=8, heads=2, head_dim=8, block_size=4)
    regions = [RemoteRegion(addr=4096 * (i + 1), block_len=100 + i, block_stride=1024)
               for i in range(lay.num_regions)]
    info = RankInfo(layout=lay, regions=regions)
    whole = RankPlan(remote_rank=0, segments=())
    spec = ReadSpec(req_id="r", peer="p", local_rank=(0, 0), local_blocks=[1, 2, 3], remote_blocks=[4, 5, 6],
                    plans=[whole], pairing=BlockPairing(1, False), deadline=time.monotonic() + 1.0)
    assert read_bound(spec, info) == 3 * sum(r.block_len for r in regions)
    cut = dataclasses.replace(whole, local_region0=2, remote_region0=2, num_regions=2)
    assert read_bound(dataclasses.replace(spec, plans=[cut]), info) == 3 * (102 + 103)
    off_by_one = dataclasses.replace(cut, local_region0=3)
    assert read_bound(dataclasses.replace(spec, plans=[off_by_one]), info) == 3 * (103 + 104)
    both = dataclasses.replace(spec, plans=[cut, whole])
    assert read_bound(both, info) == 3 * sum(r.block_len for r in regions)


def test_a_prompt_held_in_chunks_wakes_readers_of_chunks_and_not_older_readers() -> None:
    """A prompt computed in chunks (push, #36): its first blocks complete in every layer as
    each chunk is computed (the least of every rank), each change a new version; a reader of
    chunks is answered at each, an older reader (``LayerWatch``) only once the last chunk is
    held and layers are ready (it never sees a list that is not the last)."""
    book = LayerBook()
    key = ("P", "t")
    book.start(key, {0: (0, 4)}, 2, partial=True)
    assert book.watch(key, 0, "new", seen=0) is False
    assert book.watch(key, 0, "old") is False  # (partial: the older reader waits)
    assert book.report(key, 0, 0, 0, blocks=5) == []  # (rank 1 has not computed them)
    assert book.report(key, 0, 1, 0, blocks=5) == ["new"]
    prog = book.get(key)
    assert prog is not None
    assert (prog.complete, prog.ready, prog.version) == (5, 0, 1)
    assert book.watch(key, 0, "new", seen=1) is False
    assert book.extend(key, partial=False) == ["new"]  # the last chunk held
    assert book.watch(key, 0, "new", seen=2) is False
    assert book.report(key, 0, 0, 2) == []
    assert sorted(book.report(key, 0, 1, 3)) == ["new", "old"]  # layers 0-1 of the last chunk, on both ranks


def test_chunk_pairs_and_what_is_left_after_them() -> None:
    from kvxfer.protocol import LayersAt, Recv
    from kvxfer.sidecar.layer_stream import after_chunks, chunk_pairs

    # a prompt of 8 blocks; the decode had its first 3 (a prefix hit): its 5 blocks are positions 3-7
    local, remote = [50, 51, 52, 53, 54], [10, 11, 12, 13, 14]  # (the prefill's first chunk: 5 blocks)
    assert chunk_pairs(local, remote, 8, 0, 5) == ([50, 51], [13, 14])
    assert chunk_pairs(local, remote, 8, 5, 5) == ([], [])
    assert chunk_pairs([1] * 9, remote, 8, 0, 5) is None  # (more blocks than the prompt has)
    full = [10, 11, 12, 13, 14, 15, 16, 17]
    msg = Recv(req_id="r", block_ids=local, remote_engine_id="P", remote_host="h", remote_port=1,
               remote_block_ids=full[3:])
    ans = LayersAt(seq=0, held="held", block_ids=full, num_tokens=8 * 16 - 5)
    rest = after_chunks(msg, ans, 5, 16)
    assert (rest.block_ids, rest.remote_block_ids) == ([52, 53, 54], [15, 16, 17])
    with pytest.raises(RequestError):
        after_chunks(msg, LayersAt(seq=0, held="held", block_ids=full, num_tokens=4 * 16), 5, 16)


def test_group_chunk_pairs_and_what_is_left_of_each_group_after_them() -> None:
    """Several KV cache groups held chunk by chunk: only the groups the prefill holds by chunk
    (its partial lists not empty: full attention) are read as chunks, each at its prompt
    positions (a decode's prefix hit leaves positions out), a null block skipped; at the end
    each such group loses the positions read, on both sides, and the rest pairs as before."""
    from kvxfer.pairing import pair_groups
    from kvxfer.protocol import LayersAt, Recv
    from kvxfer.sidecar.layer_stream import after_group_chunks, group_chunk_pairs

    # a prompt of 8 blocks of 16 (120 tokens); groups: full, window, state; the decode had the
    # first 2 blocks (prefix hit): its full list is positions 2-7
    local = [[50, 51, 52, 53, 54, 55], [61, 62], [70]]
    partial = [[10, 11, 12, 13, 14], [], []]  # (the prefill's first chunk: 5 blocks of the full group)
    state = [False, False, True]
    assert group_chunk_pairs(local, partial, state, 8, 0, 5) == ([50, 51, 52], [12, 13, 14], [0])
    assert group_chunk_pairs(local, partial, state, 8, 5, 5) == ([], [], [0])
    assert group_chunk_pairs(local, [[10, 0, 12], [], []], state, 8, 0, 3) == ([50], [12], [0])  # (a null)
    assert group_chunk_pairs(local[:2], partial, state, 8, 0, 5) is None  # (another number of groups)
    assert group_chunk_pairs([[1] * 9, [], []], partial, state, 8, 0, 5) is None  # (more than the prompt)
    assert group_chunk_pairs(local, [[], [], [9]], state, 8, 0, 5) == ([], [], [])  # (a state: at the end)
    final = [[10, 11, 12, 13, 14, 15, 16, 17], [0, 26, 27], [30]]
    msg = Recv(req_id="r", block_ids=[b for g in local[:2] for b in g], remote_engine_id="P", remote_host="h",
               remote_port=1, remote_block_ids=[], groups=local, state_groups=state, num_tokens=120)
    ans = LayersAt(seq=0, held="held", groups=final, num_tokens=120)
    rest, rest_ans = after_group_chunks(msg, ans, 5, {0: partial[0]}, 16)
    assert rest.groups == [[53, 54, 55], [61, 62], [70]]
    assert rest_ans.groups == [[15, 16, 17], [0, 26, 27], [30]]
    # what is left pairs as the whole would, less what was read
    whole, left = pair_groups(local, final, state), pair_groups(rest.groups, rest_ans.groups, state)
    assert left.local == [53, 54, 55, 61, 62]
    assert set(whole.local) - set(left.local) == {50, 51, 52}
    assert (left.state_local, left.state_remote) == ([70], [30])
    # the final list must be the prompt's length and start with the blocks read
    for bad in ([[10, 11, 99, 13, 14, 15, 16, 17], [0, 26, 27], [30]],
                [[10, 11, 12, 13, 14, 15, 16], [0, 26, 27], [30]]):
        with pytest.raises(RequestError):
            after_group_chunks(msg, LayersAt(seq=0, held="held", groups=bad, num_tokens=120), 5,
                               {0: partial[0]}, 16)


def test_a_partial_prefix_hit_with_block_sizes_that_differ_is_not_read() -> None:
    """Blocks of 16 tokens here, of 32 at the prefill, a 64-token prompt, the decode's first
    block a local prefix hit: the pairing lines both lists up from the first token, so local
    block 1 (tokens 16-31) got the prefill's tokens 0-15 and every block after shifted too,
    delivered as proven (found by a review). Refused now (the prompt is computed here); the
    whole prompt's blocks still pair."""
    from unittest import mock

    from kvxfer.errors import ErrorCode
    from kvxfer.protocol import LayersAt, Recv
    from kvxfer.sidecar.stream_feed import completed
    from kvxfer.testing.engine import make_layout

    local = make_layout(layers=2, num_blocks=16, heads=2, head_dim=8, block_size=16)
    ans = LayersAt(seq=1, held="held", ready=2, total=2, block_ids=[10, 11], num_tokens=64, tp_size=1,
                   engine_id="p")
    peer = mock.Mock(generation="g")

    def recv(blocks: list[int]) -> Recv:
        return Recv(req_id="t", block_ids=blocks, remote_engine_id="p", remote_host="h", remote_port=1,
                    remote_block_ids=[], streamed=True)

    with pytest.raises(RequestError) as refused:
        completed(recv([5, 6, 7]), ans, peer, False, local)
    assert refused.value.code == ErrorCode.INCOMPATIBLE
    assert completed(recv([4, 5, 6, 7]), ans, peer, False, local).remote_block_ids == [10, 11]
