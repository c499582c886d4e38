"""Prefill and decode engines whose blocks hold different numbers of tokens, in vLLM's real
Scheduler with the kvxfer connector, KV moved by real sidecars over NIXL: every loaded token's
K and V must land at its own position (the decode pairs the two block lists by token, with the
prefill's block size from ``kv_transfer_params``), or the load is refused and the prompt
computed here; never a token's KV at another token's place."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from kvxfer.testing.procs import SidecarFactory
from tests.vllm_harness import LAYERS, Engine, make_config, make_request, write_tiny_model


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Prefill and decode engines with blocks of 16 and of 32 tokens."""
    model = write_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
    started: dict[str, Engine] = {}
    with SidecarFactory() as f:
        try:
            for role, bs in (("p", 16), ("p", 32), ("d", 16), ("d", 32)):
                side = f.start(f"bs-{role}{bs}", "--handshake-timeout-s", "1")
                # (the decode of 16: vLLM's default failure policy, "fail": a load it counts on
                # and that fails fails the request)
                extra = ({"lease_s": 20} if role == "p" else
                         {"transfer_timeout_s": 5, "policy": "fail" if bs == 16 else "recompute"})
                started[f"{role}{bs}"] = Engine.start(f"{role}{bs}", make_config(model, side.endpoint,
                                                                                   block_size=bs, **extra))
            yield started
        finally:
            for e in started.values():
                e.shutdown()


def size(e: Engine) -> int:
    return e.config.cache_config.block_size


def token_kv(e: Engine, blocks: list[int], pos: int) -> list[torch.Tensor]:
    """Token ``pos``'s K and V in every layer, wherever ``e``'s blocks keep it."""
    b, off = blocks[pos // size(e)], pos % size(e)
    return [e.kv[0][layer][:, b, off].clone() for layer in LAYERS]


def prefill(p: Engine, n: int, seed: int) -> tuple[dict, list[list[torch.Tensor]]]:
    """A prompt of ``n`` tokens computed on ``p``: its kv_transfer_params, every token's KV."""
    req = make_request(n, params={"do_remote_decode": True}, seed=seed, block_size=size(p))
    p.scheduler.add_request(req)
    p.run_until(lambda: p.finished(req.request_id), what="prefill to finish")
    params = p.outputs[req.request_id].kv_transfer_params
    assert params is not None
    blocks = p.blocks(req.request_id)
    return params, [token_kv(p, blocks, pos) for pos in range(n)]


def decode(d: Engine, n: int, seed: int, params: dict) -> tuple[int, list[list[torch.Tensor]], dict]:
    """The same prompt on ``d`` with the prefill's params: the tokens it computed in its first
    step (1: only the last prompt token, the rest loaded), every token's KV, its load stats."""
    req = make_request(n, params=copy.deepcopy(params), max_tokens=2, seed=seed, block_size=size(d))
    before = dict(d.worker.get_kv_connector_stats().data) if d.worker.get_kv_connector_stats() else {}
    d.scheduler.add_request(req)
    d.run_until(lambda: req.request_id in d.scheduled, what="KV to arrive or the prompt computed")
    blocks = d.blocks(req.request_id)
    got = [token_kv(d, blocks, pos) for pos in range(n)]
    computed = d.scheduled[req.request_id][0]
    d.run_until(lambda: d.finished(req.request_id), what="decode to finish")
    d.run_until(d.is_empty, what="decode blocks to be freed")
    stats = d.worker.get_kv_connector_stats()
    after = dict(stats.data) if stats is not None else {}
    return computed, got, {k: after.get(k, 0) - before.get(k, 0) for k in ("recv_ok", "recv_failed")}


def wrong_tokens(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> list[int]:
    return [pos for pos, (g, w) in enumerate(zip(got, want, strict=True))
            if not all(torch.equal(a, b) for a, b in zip(g, w, strict=True))]


@pytest.mark.parametrize("pair", ["p16-d32", "p32-d16"])
@pytest.mark.parametrize("n", [5, 20, 51, 112])
def test_every_token_lands_at_its_own_position(engines: dict[str, Engine], pair: str, n: int) -> None:
    p, d = (engines[k] for k in pair.split("-"))
    seed = n * 3 + size(p)
    params, want = prefill(p, n, seed)
    assert params["remote_block_size"] == size(p)
    computed, got, stats = decode(d, n, seed, params)
    assert computed == 1, f"the decode computed {computed} prompt tokens: its load did not happen ({stats})"
    assert stats == {"recv_ok": 1, "recv_failed": 0}
    assert wrong_tokens(got, want) == []
    p.run_until(p.is_empty, what="prefill blocks released by the read")


def test_a_cached_prefix_on_the_decode_loads_only_the_rest(engines: dict[str, Engine]) -> None:
    """Decode blocks of 32, prefill blocks of 16: 64 tokens cached here, the rest loaded."""
    p, d = engines["p16"], engines["d32"]
    n, seed = 112, 41
    warm = make_request(70, seed=seed, block_size=32)  # (its first two blocks: the same 64 tokens)
    d.scheduler.add_request(warm)
    d.run_until(lambda: d.finished(warm.request_id), what="local warm-up")
    params, want = prefill(p, n, seed)
    computed, got, stats = decode(d, n, seed, params)
    assert computed == 1
    assert stats == {"recv_ok": 1, "recv_failed": 0}
    assert wrong_tokens(got, want) == []
    p.run_until(p.is_empty, what="prefill blocks released by the read")


def test_a_cached_prefix_ending_inside_a_prefill_block_is_computed_here(engines: dict[str, Engine]) -> None:
    """Decode blocks of 16, prefill blocks of 32, 16 tokens cached here: the loaded tokens would
    start inside a prefill block, which the pairing cannot say; the prompt is computed here (not
    claimed: under vLLM's default failure policy a claimed load that fails fails the request,
    found by a review) and the prefill's blocks are released."""
    p, d = engines["p32"], engines["d16"]
    n, seed = 100, 43
    warm = make_request(20, seed=seed, block_size=16)
    d.scheduler.add_request(warm)
    d.run_until(lambda: d.finished(warm.request_id), what="local warm-up")
    params, want = prefill(p, n, seed)
    computed, got, _ = decode(d, n, seed, params)
    assert computed == n - 16
    assert wrong_tokens(got, want) == []
    p.run_until(p.is_empty, what="prefill blocks released after the refusal")


def test_lists_paired_for_the_wrong_block_size_are_refused_by_the_sidecar(engines: dict[str, Engine]) -> None:
    """A prefill that does not say its block size (an older connector): the decode pairs the
    lists as if the sizes were equal. One decode block for two prefill blocks fits the ratio's
    lengths, and was read, wrong: tokens 16..18 never moved. The decode's sidecar now refuses
    it, and the prompt is computed here."""
    p, d = engines["p16"], engines["d32"]
    n, seed = 20, 47
    params, want = prefill(p, n, seed)
    del params["remote_block_size"]
    computed, got, stats = decode(d, n, seed, params)
    assert (computed, stats["recv_ok"]) == (n, 0), "a load paired for equal blocks was read"
    assert wrong_tokens(got, want) == []
    p.run_until(p.is_empty, what="prefill blocks released after the refusal")
