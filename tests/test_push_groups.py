"""Push mode for models of several KV cache groups (#36 item 3) on real sidecars: real
``kvxfer serve`` processes, real NIXL reads on shared host memory, every byte checked.

A hybrid engine here has attention layers (one KV tensor each, shared in vLLM by one layer of
each group: a full-attention group and a sliding-window one) and state layers (Mamba/GDN).
The prefill holds its lists per group (``Hold.groups``, as its connector cuts them), the
decode names its own (``Recv.groups``); the decode's sidecar pairs them once the prefill's
sidecar names the prefill's (as pull pairs them: each group at its tail, a window's tail only,
the state's one block), reads each attention layer as it is computed, and the state only
once the prefill's forward is over (its last "layer").
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.client import GroupedLoad
from kvxfer.errors import ErrorCode
from kvxfer.protocol import LayersDone
from kvxfer.sidecar.stream_feed import WATCH_WAIT_S
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory
from tests.test_push import pair as started_pair
from tests.test_push import streamed_remote
from tests.test_sidecar import wait_for

LAYERS = 6
STATE = 4096  # bytes of one request's state per state layer
STATE_FLAGS = [False, False, True]  # full attention, sliding window, state
TOKENS = 80  # the prompt tokens the prefill computes (and the decode loads)


@pytest.fixture
def pair(sidecars: SidecarFactory) -> Iterator[tuple[SyntheticEngine, SyntheticEngine]]:
    layout = make_layout(layers=LAYERS, num_blocks=64, heads=2, head_dim=64, state_layers=2,
                         state_bytes=STATE)
    with started_pair(sidecars, "groups", prefill_args=("--lease-s", "30"), layout=layout) as (_, _, d, p):
        yield p, d


def state_of(e: SyntheticEngine, block: int) -> np.ndarray:
    return e.kv.state_blocks()[:, block, :].copy()  # type: ignore[union-attr]


def test_a_hybrid_request_streams_its_layers_by_group_and_its_state_last(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    p, d = pair
    for rnd, hit in enumerate((0, 2)):  # (then a partial prefix hit on the decode: its 2 first blocks)
        tid = f"hybrid-{rnd}"
        pf, pw, (ps,) = p.allocate(5), p.allocate(3), p.allocate(1)
        df, dw, (ds,) = d.allocate(5), d.allocate(3), d.allocate(1)
        df_load = df[hit:]  # (the decode's lists as its connector gives them: its prefix hit left out)
        # the prefill's window list has vLLM's null block in front (out of the window)
        p_groups, d_groups = [pf, [0, *pw[1:]], [ps]], [df_load, dw[1:], [ds]]
        # pairs as pull makes them: each group at its tail, a null on either side skipped
        remote, local = pf[hit:] + pw[1:], df_load + dw[1:]
        d.wipe(df + dw)
        d.kv.state_blocks()[:, ds, :] = 0  # type: ignore[union-attr]
        p.wipe(pf + pw)
        p.kv.state_blocks()[:, ps, :] = 0  # type: ignore[union-attr]
        p.client.hold(tid, [b for g in p_groups for b in g if b], token=tid, streamed=True,
                      expires_unix=time.time() + 60, groups=p_groups, num_tokens=TOKENS)
        d.client.recv(tid, local, streamed_remote(p, tid), streamed=True, deadline_s=30,
                      groups=GroupedLoad(d_groups, STATE_FLAGS, TOKENS))
        for layer in range(LAYERS):  # the prefill computes one attention layer at a time
            p.fill_layers(tid, remote, range(layer, layer + 1))
            p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
            time.sleep(0.02)
        deadline = time.monotonic() + 10  # every attention layer read while the state is not
        while not d.verify_layers(tid, local, range(LAYERS)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.verify_layers(tid, local, range(LAYERS)), "the computed layers did not move meanwhile"
        time.sleep(0.2)
        assert not d.client.poll().done, "done before the prefill's forward was over"
        assert not state_of(d, ds).any(), "the state was read before the prefill finished it"
        p.fill_state(tid, [ps])  # the forward is over: the state is whole
        p.client.send(LayersDone(req_ids=[tid], layers=LAYERS + 1))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got.failed
        assert d.verify(tid, local), "attention bytes differ"
        assert d.verify_state(tid, [ds]), "state bytes differ"
        assert got.done[0].nbytes == len(local) * d.layout.num_regions * d.layout.region_block_len + 2 * STATE
        assert not d.kv.blocks()[:, :, [dw[0], *df[:hit]], :].any(), "a block outside the pairs was written"  # type: ignore[union-attr]
        wait_for(p.client, lambda a: bool(a.released))
        p.free(pf + pw + [ps])
        d.free(df + dw + [ds])


def test_a_grouped_load_that_cannot_be_paired_fails_and_releases_the_prefill(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    """Another number of prompt tokens at the prefill (its state would be another prompt's),
    a prefill held without groups, a decode list longer than the prefill's, a decode without
    groups: refused
    ``incompatible`` before anything is read; the prefill's lease ends, the engine goes on. The
    prefill computes no layer here: the decode's first watch is answered at once
    (``ChunkWatch.now``), so each fails well before a watch's wait (``WATCH_WAIT_S``, 5 s: until
    2026-11-29 each case waited that long for the first answer)."""
    p, d = pair
    cases = {
        "tokens": ([[1, 2], [3], [4]], TOKENS + 1, [[11, 12], [13], [14]]),
        "no-groups": (None, 0, [[11, 12], [13], [14]]),
        "longer": ([[1, 2], [3], [4]], TOKENS, [[10, 11, 12], [13], [14]]),
    }
    for name, (p_groups, tokens, d_groups) in cases.items():
        tid = f"bad-{name}"
        p.client.hold(tid, [1, 2, 3, 4], token=tid, streamed=True, expires_unix=time.time() + 60,
                      groups=p_groups, num_tokens=tokens)
        d.client.recv(tid, [b for g in d_groups[:2] for b in g], streamed_remote(p, tid), streamed=True,
                      deadline_s=30, groups=GroupedLoad(d_groups, STATE_FLAGS, TOKENS))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=WATCH_WAIT_S * 0.8)
        assert got.failed, (name, got)
        assert got.failed[0].code == ErrorCode.INCOMPATIBLE, (name, got)
        released = wait_for(p.client, lambda a: bool(a.released), timeout=10)
        assert released.released[0].req_id == tid, (name, released)
    # a decode naming one list (its hybrid KV cache manager off?) of a prefill holding groups:
    # paired as one list it would read the groups' blocks in the wrong places (found by review)
    p.client.hold("bad-flat", [1, 2, 3, 4], token="bad-flat", streamed=True, expires_unix=time.time() + 60,
                  groups=[[1, 2], [3], [4]], num_tokens=TOKENS)
    d.client.recv("bad-flat", [11, 12, 13], streamed_remote(p, "bad-flat"), streamed=True, deadline_s=30)
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=WATCH_WAIT_S * 0.8)
    assert got.failed, got
    assert got.failed[0].code == ErrorCode.INCOMPATIBLE, got
    assert "per KV cache group" in got.failed[0].reason, got
    released = wait_for(p.client, lambda a: bool(a.released), timeout=10)
    assert released.released[0].req_id == "bad-flat", released


def test_a_watch_parked_before_its_hold_is_answered_when_the_hold_comes(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    """The decode dispatched first: its first watch waits at the prefill for the Hold, and is
    answered as soon as that comes, no layer computed (``FIRST_SEEN``): a load whose groups
    cannot be paired fails then, not after a watch's wait for the first layer."""
    p, d = pair
    tid = "early-unpaired"
    d.client.recv(tid, [11, 12, 13], streamed_remote(p, tid), streamed=True, deadline_s=30,
                  groups=GroupedLoad([[11, 12], [13], [14]], STATE_FLAGS, TOKENS))
    time.sleep(0.3)  # (its watch is parked there now)
    assert not d.client.poll().failed
    p.client.hold(tid, [1, 2, 3, 4], token=tid, streamed=True, expires_unix=time.time() + 60,
                  groups=[[1, 2], [3], [4]], num_tokens=TOKENS + 1)  # (another prompt length)
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=WATCH_WAIT_S * 0.8)
    assert got.failed, got
    assert got.failed[0].code == ErrorCode.INCOMPATIBLE, got
    released = wait_for(p.client, lambda a: bool(a.released), timeout=10)
    assert released.released[0].req_id == tid, released


def test_a_hold_whose_groups_name_blocks_it_does_not_hold_is_refused(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    p, _ = pair
    p.client.hold("stray", [1, 2], token="stray", streamed=True, groups=[[1, 2], [9]], num_tokens=TOKENS)
    got = wait_for(p.client, lambda a: bool(a.errors), timeout=10)
    assert got.errors[0].code == ErrorCode.MALFORMED, got.errors


@pytest.mark.parametrize("hit", [0, 2])  # (2: the decode had the prompt's first 2 blocks already)
def test_a_hybrid_prompt_computed_in_chunks_is_read_chunk_by_chunk(
        pair: tuple[SyntheticEngine, SyntheticEngine], hit: int) -> None:
    """A hybrid prompt the prefill computes in chunks (#36: "each chunk's layers are pushed as
    they complete", for every group): an earlier chunk holds the full-attention group's blocks
    so far (the window's and the state's lists empty: vLLM frees window blocks as the prompt
    moves on, a state is whole only at the end); the decode reads them, every layer, while the
    prefill computes on; the last chunk holds every group's lists, and only what was not read
    as a chunk is read then, the window's tail and the state last. Every pair read once."""
    p, d = pair
    tid = f"hybrid-chunks-{hit}"
    bs = p.layout.block_size
    tokens = 8 * bs - 5  # (the last block partly filled)
    pf, pw, (ps,) = p.allocate(8), p.allocate(3), p.allocate(1)
    df, dw, (ds,) = d.allocate(8), d.allocate(3), d.allocate(1)
    df_load = df[hit:]
    p_final, d_groups = [pf, [0, *pw[1:]], [ps]], [df_load, dw[1:], [ds]]
    remote, local = pf[hit:] + pw[1:], df_load + dw[1:]  # (pairs as pull makes them)
    d.wipe(df + dw)
    d.kv.state_blocks()[:, ds, :] = 0  # type: ignore[union-attr]
    p.wipe(pf + pw)
    # the first chunk is scheduled: the full-attention group's blocks of it held, partial
    p.client.hold(tid, pf[:5], token=tid, streamed=True, partial=True, expires_unix=time.time() + 60,
                  groups=[pf[:5], [], []], num_tokens=tokens)
    d.client.recv(tid, local, streamed_remote(p, tid), streamed=True, deadline_s=30,
                  groups=GroupedLoad(d_groups, STATE_FLAGS, tokens))
    p.fill(tid, remote[:5 - hit])  # the first chunk computed (its first 5 blocks whole, every layer)
    p.client.send(LayersDone(req_ids=[tid], layers=0, blocks=5))
    deadline = time.monotonic() + 10
    while not d.verify(tid, local[:5 - hit]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.verify(tid, local[:5 - hit]), "the first chunk did not move while the prefill went on"
    assert not d.client.poll().done
    assert not d.kv.blocks()[:, :, dw, :].any(), "a window block was read before the last chunk"  # type: ignore[union-attr]
    # the last chunk: every group's lists as vLLM will finish them, its layers one by one
    p.client.hold(tid, [b for g in p_final for b in g if b], token=tid, streamed=True, extends=True,
                  groups=p_final, num_tokens=tokens, expires_unix=time.time() + 60)
    for layer in range(LAYERS):
        p.fill_layers(tid, remote, range(layer, layer + 1))
        p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
    p.fill_state(tid, [ps])
    p.client.send(LayersDone(req_ids=[tid], layers=LAYERS + 1))
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
    assert got.done, got.failed
    assert d.verify(tid, local), "attention bytes differ"
    assert d.verify_state(tid, [ds]), "state bytes differ"
    block = d.layout.num_regions * d.layout.region_block_len
    assert got.done[0].nbytes == len(local) * block + 2 * STATE  # (a chunk's blocks not read again)
    assert not d.kv.blocks()[:, :, [dw[0], *df[:hit]], :].any(), "a block outside the pairs was written"  # type: ignore[union-attr]
    wait_for(p.client, lambda a: bool(a.released))


def test_a_grouped_chunk_extension_must_keep_every_group_held(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    """An extension of a hybrid hold computed in chunks: each group held so far must start with
    its blocks held, no held block may be let go, the groups as many: else the lease ends
    (one Released, ``aborted``) and the refusal is ``incompatible``; a good one is taken."""
    p, _ = pair
    pf, pw, (ps,) = p.allocate(4), p.allocate(2), p.allocate(1)
    bad = {
        "reordered": [[pf[1], pf[0], *pf[2:]], pw, [ps]],
        "let go": [pf[1:], pw, [ps]],
        "fewer groups": [pf, pw],
    }
    for i, (what, groups) in enumerate(bad.items()):
        tid = f"grow-{i}"
        p.client.hold(tid, pf[:2], token=tid, streamed=True, partial=True, groups=[pf[:2], [], []],
                      num_tokens=4 * p.layout.block_size)
        p.client.hold(tid, [b for g in groups for b in g], token=tid, streamed=True, extends=True,
                      groups=groups, num_tokens=4 * p.layout.block_size)
        got = wait_for(p.client, lambda a: bool(a.errors and a.released), timeout=10)
        assert got.errors[0].code == ErrorCode.INCOMPATIBLE, (what, got.errors)
        assert [(r.req_id, r.reason) for r in got.released] == [(tid, "aborted")], what
    p.client.hold("grow-ok", pf[:2], token="grow-ok", streamed=True, partial=True, groups=[pf[:2], [], []],
                  num_tokens=4 * p.layout.block_size)
    p.client.hold("grow-ok", [*pf, *pw, ps], token="grow-ok", streamed=True, extends=True,
                  groups=[pf, pw, [ps]], num_tokens=4 * p.layout.block_size)
    time.sleep(0.3)
    assert not p.client.poll().errors
    p.client.release("grow-ok")
    wait_for(p.client, lambda a: bool(a.released), timeout=10)


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (4, 2)])
def test_a_hybrid_request_streams_between_different_tp_sizes(sidecars: SidecarFactory, ptp: int,
                                                             dtp: int) -> None:
    """Push of a hybrid (full attention + Mamba2 state, one replicated group) between TP sizes:
    each decode rank follows the prefill ranks layer by layer, then reads its share of the state
    (the state parts: kvxfer.connector.state_parts) from the prefill ranks that hold it, once
    every prefill rank's forward is over. Every attention and state byte of every decode rank."""
    from tests.test_state_e2e import mamba2_layout

    ds = sidecars.start(f"pushs-d{ptp}{dtp}", "--verify-sample", "0")
    ps = sidecars.start(f"pushs-p{ptp}{dtp}", "--lease-s", "30")
    pre = [SyntheticEngine(mamba2_layout(ptp, r, False, 1), ps.endpoint, seed=3) for r in range(ptp)]
    dec = [SyntheticEngine(mamba2_layout(dtp, r, False, 1), ds.endpoint, seed=7) for r in range(dtp)]
    try:
        for e in (*pre, *dec):
            e.start()
        tid, pf, psb, df, dsb, tokens = f"hybrid-tp{ptp}{dtp}", [3, 9, 5], 11, [4, 8, 6], 12, 40
        for e in dec:
            e.wipe(df)
            e.kv.state_blocks()[:, dsb, :] = 0  # type: ignore[union-attr]
        pre[0].client.hold(tid, [*pf, psb], token=tid, streamed=True, notify_ranks=True,
                           expires_unix=time.time() + 60, groups=[pf, [psb]], num_tokens=tokens)
        for r, e in enumerate(dec):
            e.client.recv(tid, df, streamed_remote(pre[0], tid), tp_rank=r, streamed=True, deadline_s=30,
                          groups=GroupedLoad([df, [dsb]], [False, True], tokens))
        for r, e in enumerate(pre):  # (rank after rank)
            for layer in range(e.layout.num_layers):
                e.fill_layers(tid, pf, range(layer, layer + 1))
                e.client.send(LayersDone(req_ids=[tid], layers=layer + 1, tp_rank=r))
            e.fill_state(tid, [psb])  # its forward is over: its state is whole
            e.client.send(LayersDone(req_ids=[tid], layers=e.layout.num_layers + 1, tp_rank=r))
        for e in dec:
            got = wait_for(e.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert got.done, got.failed
            assert e.verify(tid, df), f"decode rank {e.layout.tp_rank}: attention bytes differ"
            assert e.verify_state(tid, [dsb]), f"decode rank {e.layout.tp_rank}: state bytes differ"
        wait_for(pre[0].client, lambda a: bool(a.released))
    finally:
        for e in (*pre, *dec):
            e.close()
