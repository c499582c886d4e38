"""Hybrid pull pairing (from a review): vLLM's own KVCacheManager gives the prefill's and the
decode's per-group block lists (allocation, freeing of out-of-window blocks, prefix hits,
Mamba's running-state slot); kvxfer's clip + pair_load must pair every block the decode keeps
(vLLM does not zero them: get_loaded_kv_cache_group_ids) with the prefill block of the same
position, or refuse (the prompt computed here). Found: a prefill that computed more than the
decode loads (every block one position off), multi-module MTP's retained window blocks
(never written, then in the prefix cache), another group count refused only after allocation."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from kvxfer.client import RemoteBlocks
from kvxfer.connector.groups import Groups
from kvxfer.connector.loads import pair_load

BS = 32


def cfg(window: int, extra: int = 0) -> KVCacheConfig:
    sw = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           sliding_window=window, extra_retained_tokens=extra)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["sw"], sw), KVCacheGroupSpec(["full"], full)])


def manager(c: KVCacheConfig) -> KVCacheManager:
    return KVCacheManager(c, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=False)


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), None)


def prefill_lists(c: KVCacheConfig, computed: int) -> list[list[int]]:
    """The lists vLLM hands request_finished_all_groups once the prefill computed ``computed``."""
    m, r = manager(c), req("p", computed)
    m.allocate_slots(r, computed)
    r.num_computed_tokens = computed
    m.remove_skipped_blocks("p", computed, num_prompt_tokens=computed)  # (_connector_finished)
    return [list(g) for g in m.get_block_ids_for_computed_tokens("p", computed)]


def decode_lists(c: KVCacheConfig, prompt: int, load: int) -> tuple[list[list[int]], list[list[int]]]:
    """(every block the decode holds per group, the unhashed ones as the connector reads them)."""
    m, r = manager(c), req("d", prompt)
    blocks = m.allocate_slots(r, 0, num_external_computed_tokens=load, delay_cache_blocks=True)
    assert blocks is not None
    allb = m.get_blocks("d")
    return [list(g) for g in allb.get_block_ids()], allb.get_unhashed_block_ids_all_groups()


def params_of(theirs: list[list[int]]) -> RemoteBlocks:
    """What the decode's connector parses from the prefill's (clipped) lists per group."""
    return RemoteBlocks("p", "h", 1, [b for x in theirs for b in x if b], groups=tuple(map(tuple, theirs)),
                        block_size=BS)


def load_after_hit(m: KVCacheManager, r: Request, n: int, h: int, hit_blocks: Any) -> Any:
    """vLLM's allocation for a load of ``n`` tokens on top of a local hit of ``h``, as its
    scheduler does it for an async load; the request's blocks."""
    assert m.allocate_slots(r, 0, num_new_computed_tokens=h, new_computed_blocks=hit_blocks,
                            num_external_computed_tokens=n - h, delay_cache_blocks=True) is not None
    return m.get_blocks(r.request_id)


def check(c: KVCacheConfig, prompt: int, load: int, computed: int) -> None:
    """Every block the decode keeps gets its own position's KV."""
    g = Groups.from_config(c)
    theirs = g.clip(prefill_lists(c, computed))
    held_d, unhashed = decode_lists(c, prompt, load)
    mine = g.clip(unhashed)
    remote = params_of(theirs)
    pairs = pair_load(mine, remote, g.state, BS, load, load)
    got = dict(zip(pairs.local, pairs.remote, strict=True))
    p_full = prefill_lists(c, computed)
    for gi in range(2):
        for pos, b in enumerate(held_d[gi]):
            if b == 0:
                continue  # (vLLM's null block: nothing kept there)
            assert b in got, f"group {gi}: decode block at position {pos} kept, never written"
            assert got[b] == p_full[gi][pos], f"group {gi}: decode block {pos} <- another position's"


@pytest.mark.parametrize("prompt", range(2, 200))
def test_symmetric_backoff_pairs_every_kept_block_by_position(prompt: int) -> None:
    """The shipped configuration (prefill stops one short, decode loads prompt - 1): fine."""
    check(cfg(64), prompt, prompt - 1, prompt - 1)


@pytest.mark.parametrize("prompt", [34, 65, 97, 129])
def test_prefill_that_computed_one_more_than_loaded(prompt: int) -> None:
    """A prefill that did not stop short (an older connector version, prompt logprobs there,
    or a decode with a larger back-off: multi-module MTP on the decode only) reports
    remote_num_tokens = prompt; this decode loads prompt - 1. One KV cache group: cut_to_load
    pairs by position (tests/test_connector_lifecycle.py). Several: lists lined up at the tail
    with the prefill's extra block put every block one position off, silently. Now such a load
    is not claimed (computed here): the scheduler never pairs these lists."""
    from kvxfer.connector.scheduler import tokens_to_load

    assert tokens_to_load(prompt, 1, prompt, False, grouped=True) < 0
    assert tokens_to_load(prompt, 1, prompt - 1, False, grouped=True) == prompt - 1
    assert tokens_to_load(prompt, 1, prompt, False) == prompt - 1  # (one group: cut_to_load pairs it)


@pytest.mark.parametrize("prompt", range(60, 200))
def test_multi_module_mtp_retained_sliding_window_blocks_are_all_moved(prompt: int) -> None:
    """vLLM tags every SlidingWindowSpec with extra_retained_tokens = num_prefill_lookahead - 1
    under multi-module MTP (kv_cache_planning) and keeps those blocks on both sides; the clip
    (cdiv(window, bs) + 1) leaves the oldest of them unwritten on the decode, and vLLM does not
    zero them (the group is 'loaded'); once the load ends they enter its prefix cache."""
    backoff = 3  # (num_speculative_tokens 4: lookahead 4, back-off 3, extra_retained 3)
    check(cfg(64, extra=3), prompt, prompt - backoff, prompt - backoff)


def test_scheduler_side_pairs_a_longer_prefill_of_several_groups_by_position() -> None:
    """The same through SchedulerSide (as tests/test_connector_lifecycle.py's one-group case):
    33 tokens computed by the prefill, 32 loaded here, blocks of 16, window 64 (all kept)."""
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    sent: list[tuple[list[int], list[int]]] = []

    class Client:
        def ping(self, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(engine_id="D", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=False, chunk_streams=False, grouped_chunks=False,
                                   instance="i")

        def recv(self, req_id: str, blocks: list[int], remote: object, **kw: object) -> None:
            sent.append((list(blocks), list(remote.block_ids)))  # type: ignore[attr-defined]

    sched = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere"), 1, client=Client())  # type: ignore[arg-type]
    sched.block_size, sched.backoff, sched.grouped, sched.state_groups = 16, 1, True, (False, False)
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": [[201, 202, 203], [101, 102, 103]], "remote_num_tokens": 33, "tp_size": 1,
              "remote_block_size": 16}
    r = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=list(range(33)),
                        status=SimpleNamespace(name="WAITING"))
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    assert n == 0  # (not claimed: computed here)
    sched.update_state_after_alloc(r, [[], []], n)
    assert all(not blocks for blocks, _ in sent), sent  # (only the prefill's release)


# ------------------------------------------------------------------ decode prefix-cache hits

def _hasher():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def check_with_hit(c: KVCacheConfig, prompt: int, cached: int, backoff: int = 1) -> None:
    """The decode computed a request sharing the first ``cached`` tokens before (its blocks in
    its prefix cache), then loads ``prompt - backoff`` from the prefill, as vLLM's scheduler
    does: the local hit, the connector's count on top of it, one allocate_slots."""
    hasher = _hasher()
    toks = list(range(1, prompt + 1))
    n = prompt - backoff
    m = KVCacheManager(c, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True)
    w = Request("w", toks[:cached] + [9999] * 5, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert m.allocate_slots(w, w.num_tokens) is not None
    w.num_computed_tokens = w.num_tokens
    m.free(w)
    r = Request("d", toks, SamplingParams(max_tokens=4), None, block_hasher=hasher)
    hit_blocks, h, _ = m.get_computed_blocks(r)
    if h >= n:
        return
    allb = load_after_hit(m, r, n, h, hit_blocks)
    held_d = [list(g) for g in allb.get_block_ids()]
    g = Groups.from_config(c)
    mine = g.clip(allb.get_unhashed_block_ids_all_groups())
    p_full = prefill_lists(c, n)
    theirs = g.clip(p_full)
    remote = params_of(theirs)
    pairs = pair_load(mine, remote, g.state, BS, n, n - h)
    got = dict(zip(pairs.local, pairs.remote, strict=True))
    hashed = {b.block_id for grp in allb.blocks for b in grp if b.block_hash is not None}
    for gi in range(len(held_d)):
        for pos, b in enumerate(held_d[gi]):
            if b == 0 or b in hashed:
                continue
            assert b in got, f"group {gi}: new decode block at position {pos} never written (hit {h})"
            assert got[b] == p_full[gi][pos], f"group {gi}: position {pos} <- another position (hit {h})"


@pytest.mark.parametrize("prompt", [70, 97, 130, 161, 190])
@pytest.mark.parametrize("cached", [32, 64, 96, 128, 160])
def test_decode_prefix_hit_with_a_sliding_window(prompt: int, cached: int) -> None:
    check_with_hit(cfg(64), prompt, cached)


def cfg_local(chunk: int) -> KVCacheConfig:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    loc = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                    attention_chunk_size=chunk)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["loc"], loc), KVCacheGroupSpec(["full"], full)])


@pytest.mark.parametrize("prompt", range(2, 200, 3))
def test_chunked_local_symmetric(prompt: int) -> None:
    check(cfg_local(64), prompt, prompt - 1, prompt - 1)


@pytest.mark.parametrize("prompt", [70, 97, 130, 161, 190])
@pytest.mark.parametrize("cached", [32, 64, 96, 128])
def test_chunked_local_with_decode_hit(prompt: int, cached: int) -> None:
    check_with_hit(cfg_local(64), prompt, cached)


def cfg_mamba(spec_blocks: int) -> KVCacheConfig:
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=BS, shapes=((3, 16),), dtypes=(torch.float32,), mamba_cache_mode="align",
                      num_speculative_blocks=spec_blocks)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["m"], mamba), KVCacheGroupSpec(["full"], full)])


def prefill_chunked(c: KVCacheConfig, computed: int, first: int) -> list[list[int]]:
    m, r = manager(c), req("p", computed)
    done = 0
    for step in ([first, computed - first] if 0 < first < computed else [computed]):
        assert m.allocate_slots(r, step) is not None
        done += step
        r.num_computed_tokens = done
    m.remove_skipped_blocks("p", computed, num_prompt_tokens=computed)
    return [list(g) for g in m.get_block_ids_for_computed_tokens("p", computed)]


@pytest.mark.parametrize("spec_blocks", [0, 2])
@pytest.mark.parametrize("prompt", [33, 64, 65, 100, 129])
@pytest.mark.parametrize("first", [0, 32, 40])
def test_mamba_state_pairs_the_running_state_slots(spec_blocks: int, prompt: int, first: int) -> None:
    c = cfg_mamba(spec_blocks)
    n = prompt - 1
    g = Groups.from_config(c)
    p_full = prefill_chunked(c, n, first)
    held_d, unhashed = decode_lists(c, prompt, n)
    theirs = g.clip(p_full)
    remote = params_of(theirs)
    pairs = pair_load(g.clip(unhashed), remote, g.state, BS, n, n)
    slot = -(-n // BS) - 1
    assert (pairs.state_local, pairs.state_remote) == ([held_d[0][slot]], [p_full[0][slot]]), held_d[0]
    assert pairs.local == held_d[1]
    assert pairs.remote == p_full[1]


@pytest.mark.parametrize("spec_blocks", [0, 2])
@pytest.mark.parametrize("prompt", [70, 97, 130, 161])
@pytest.mark.parametrize("cached", [32, 64, 96, 128])
def test_mamba_with_a_decode_prefix_hit(spec_blocks: int, prompt: int, cached: int) -> None:
    c = cfg_mamba(spec_blocks)
    hasher = _hasher()
    toks = list(range(1, prompt + 1))
    n = prompt - 1
    m = KVCacheManager(c, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True)
    w = Request("w", toks[:cached] + [9999] * 5, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    done = 0
    for step in [BS] * (cached // BS) + [5]:  # (chunks ending on block boundaries: states cached there)
        assert m.allocate_slots(w, step) is not None
        done += step
        w.num_computed_tokens = done
    m.free(w)
    m.new_step_starts()  # (a later step: Mamba refuses a state cached in this one)
    r = Request("d", toks, SamplingParams(max_tokens=4), None, block_hasher=hasher)
    hit_blocks, h, _ = m.get_computed_blocks(r)
    assert h == min(cached, (prompt - 1) // BS * BS)  # (the hit is real)
    if h >= n:
        return
    allb = load_after_hit(m, r, n, h, hit_blocks)
    held_d = [list(g) for g in allb.get_block_ids()]
    g = Groups.from_config(c)
    p_full = prefill_chunked(c, n, 0)
    theirs = g.clip(p_full)
    remote = params_of(theirs)
    pairs = pair_load(g.clip(allb.get_unhashed_block_ids_all_groups()), remote, g.state, BS, n, n - h)
    slot = -(-n // BS) - 1
    assert (pairs.state_local, pairs.state_remote) == ([held_d[0][slot]], [p_full[0][slot]]), (h, held_d[0])
    assert pairs.local == held_d[1][h // BS:], h
    assert pairs.remote == p_full[1][h // BS:], h


def test_a_prefill_of_another_group_count_is_refused_before_blocks_are_allocated() -> None:
    """A prefill whose lists cannot pair with this engine's groups (one flat list: e.g. a
    prefill run with --disable-hybrid-kv-cache-manager, or another model) is known from the
    params alone; claimed anyway, the load fails after allocation, and under vLLM's default
    kv_load_failure_policy 'fail' the request fails instead of being computed here (the rule
    of commit f85b716 for unpairable block sizes)."""
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    class Client:
        def ping(self, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(engine_id="D", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=False, chunk_streams=False, grouped_chunks=False,
                                   instance="i")

        def recv(self, *a: object, **kw: object) -> None:
            pass

        def heartbeat(self) -> None:
            pass

        def poll(self) -> object:
            from kvxfer.client import Drained

            return Drained()

    sched = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere"), 1, client=Client())  # type: ignore[arg-type]
    sched.block_size, sched.backoff, sched.grouped, sched.state_groups = 16, 1, True, (False, False)
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": [101, 102, 103], "remote_num_tokens": 32, "tp_size": 1,
              "remote_block_size": 16}
    r = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=list(range(33)),
                        status=SimpleNamespace(name="WAITING"))
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, [[7, 8], [9, 10]], n)
    assert "d1" not in sched.take_plan().failed, "claimed, then failed after allocation: the request fails"


def test_a_kept_block_facing_a_block_the_prefill_freed_is_refused() -> None:
    from kvxfer.pairing import pair_groups

    with pytest.raises(ValueError, match="faces a block the prefill freed"):
        pair_groups([[5, 6], [7]], [[0, 8], [9]])
    assert pair_groups([[0, 6], [7]], [[0, 8], [9]]).local == [6, 7]  # (null on both sides: nothing kept)
