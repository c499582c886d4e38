"""Fewer descriptors (#19): rows of a block that touch on both sides become one row
(``merge_rows``), and consecutive blocks that map to consecutive remote blocks become one
descriptor (``merge_runs``). Property tests: a merged descriptor list moves exactly the bytes
of the unmerged one, each to the same place, and never spans a gap on either side."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.protocol import RemoteRegion
from kvxfer.sidecar.plan import merge_bound, merge_rows, merge_runs


def _byte_map(pairs: list[tuple[int, int, int]]) -> dict[int, int]:
    """local byte -> remote byte for (local addr, remote addr, length) copies; a byte written
    twice fails."""
    out: dict[int, int] = {}
    for la, ra, n in pairs:
        for k in range(n):
            assert la + k not in out, "a local byte written twice"
            out[la + k] = ra + k
    return out


@st.composite
def geometry(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Rows of a layer-outer (stride == len: consecutive blocks touch) or block-outermost
    (rows side by side inside a block) layout on each side, ids in [0, rows)."""
    rows = draw(st.integers(1, 4))
    length = draw(st.sampled_from([4, 8]))  # a row moves the same bytes on both sides
    out = []
    for _side in range(2):
        nb = draw(st.integers(2, 12))
        base = draw(st.integers(0, 3)) * 1000
        if draw(st.booleans()):  # layer-outer: row r is its own region of nb blocks
            geo = [(base + r * nb * length, length, length, 0) for r in range(rows)]
        else:  # block-outermost: a block holds every row, maybe with padding after them
            stride = rows * length + draw(st.sampled_from([0, 4]))
            geo = [(base + r * length, length, stride, 0) for r in range(rows)]
        out.append((np.array(geo, dtype=np.int64), nb))
    (lg, lnb), (rg, rnb) = out
    return lg, rg, lnb, rnb


@settings(max_examples=300, deadline=None)
@given(geometry(), st.data())
def test_merged_runs_move_exactly_the_same_bytes_and_never_span_a_gap(geo, data) -> None:  # type: ignore[no-untyped-def]
    lg, rg, lnb, rnb = geo
    rows = len(lg)
    n = data.draw(st.integers(1, min(lnb, rnb)))
    # block pairs: sometimes consecutive runs, sometimes shuffled (gaps), never a local block twice
    lblocks = data.draw(st.permutations(range(lnb)))[:n] if data.draw(st.booleans()) else list(range(n))
    start = data.draw(st.integers(0, rnb - n))
    rblocks = [start + k for k in range(n)] if data.draw(st.booleans()) else \
        data.draw(st.permutations(range(rnb)))[:n]
    # descriptor order as _leg_indices builds it: row-major, then blocks in request order
    li = np.array([r * lnb + b for r in range(rows) for b in lblocks], dtype=np.int64)
    ri = np.array([r * rnb + b for r in range(rows) for b in rblocks], dtype=np.int64)

    def addr(g: np.ndarray, nb: int, i: int) -> int:
        return int(g[i // nb, 0] + (i % nb) * g[i // nb, 2])

    plain = [(addr(lg, lnb, i), addr(rg, rnb, j), int(lg[i // lnb, 1])) for i, j in zip(li, ri, strict=True)]
    ld, rd = merge_runs(lg, rg, lnb, rnb, li, ri)
    assert ld.shape == rd.shape
    assert (ld[:, 1] == rd[:, 1]).all()
    merged = [(int(a), int(b), int(n)) for (a, n, _), (b, _, _) in zip(ld, rd, strict=True)]
    assert _byte_map(merged) == _byte_map(plain)
    # every run is consecutive descriptors of one row that continue each other on both sides
    k = 0
    for la, ra, length in merged:
        covered = 0
        while covered < length:
            pla, pra, plen = plain[k]
            assert (pla, pra) == (la + covered, ra + covered), "a run spans a gap"
            covered += plen
            k += 1
        assert covered == length
    assert k == len(plain)
    # merge_bound (plan_leg skips the merge below MERGE_MIN_SAVED) never says less than it saved
    bound = merge_bound([np.arange(rows)], lg, rg, [(0, np.array(lblocks), np.array(rblocks))])
    assert len(li) - len(ld) <= bound
    # and maximal: consecutive descriptors of one row that continue each other were merged
    if rows == 1:
        for (a1, b1, n1), (a2, b2, _) in zip(merged, merged[1:], strict=False):
            assert not (a1 + n1 == a2 and b1 + n1 == b2), "two continuing descriptors left apart"


def test_consecutive_blocks_become_one_descriptor_per_row() -> None:
    # layer-outer: 3 rows (layers), 32 KiB blocks; blocks 5..12 locally read remote 40..47
    nb, length = 64, 32 << 10
    geo = np.array([(r * nb * length, length, length, 0) for r in range(3)], dtype=np.int64)
    li = np.array([r * nb + b for r in range(3) for b in range(5, 13)])
    ri = np.array([r * nb + b for r in range(3) for b in range(40, 48)])
    ld, rd = merge_runs(geo, geo, nb, nb, li, ri)
    assert len(ld) == 3  # one 256 KiB run per layer
    assert (ld[:, 1] == 8 * length).all()
    assert list(ld[:, 0]) == [r * nb * length + 5 * length for r in range(3)]
    # a gap on the remote side (block 44 missing) splits each run there, and only there
    ri2 = np.array([r * nb + b for r in range(3) for b in [40, 41, 42, 43, 45, 46, 47, 48]])
    ld2, _ = merge_runs(geo, geo, nb, nb, li, ri2)
    assert len(ld2) == 6
    assert sorted(set(ld2[:, 1].tolist())) == [4 * length]


def test_rows_touching_on_both_sides_merge_into_one() -> None:
    # block-outermost: 4 layers x K/V of 1 KiB inside an 8 KiB block, on both sides
    def rows(base: int) -> list[RemoteRegion]:
        return [RemoteRegion(addr=base + i * 1024, block_len=1024, block_stride=8192) for i in range(8)]

    merged = merge_rows(list(zip(rows(0), rows(1 << 20), strict=True)))
    assert len(merged) == 1
    assert merged[0][0].block_len == 8192
    assert merged[0][1].addr == 1 << 20
    # a head slice (half of each row remotely, HND with TP 2 -> 1) does not touch: kept apart
    half = [(RemoteRegion(addr=i * 1024, block_len=512, block_stride=8192),
             RemoteRegion(addr=(1 << 20) + i * 1024, block_len=512, block_stride=8192)) for i in range(8)]
    assert len(merge_rows(half)) == 8
    # touching locally but not remotely: kept apart
    skew = [(RemoteRegion(addr=i * 1024, block_len=1024, block_stride=8192),
             RemoteRegion(addr=(1 << 20) + i * 2048, block_len=1024, block_stride=16384)) for i in range(8)]
    assert len(merge_rows(skew)) == 8


# --------------------------------------------------------------------------- real sidecars

def _demo(**kw: object) -> dict:  # type: ignore[type-arg]
    from kvxfer.testing.demo import DemoOptions, run_demo

    opts = DemoOptions(**({"requests": 3, "in_flight": 3, "layers": 8, "blocks_per_request": 8, "heads": 2,
                           "head_dim": 32, "block_size": 8} | kw))  # type: ignore[arg-type]
    res = run_demo(opts)
    assert res["problems"] == [], "\n".join(res["problems"])
    assert res["verified"] is True  # every byte of every block, read back on the decode side
    assert res["bytes"] == opts.requests * opts.request_bytes()
    return res


def test_block_outermost_layout_moves_each_block_in_one_descriptor() -> None:
    """vLLM's BLHNC (a block of every layer is one run) between equal TP sizes: one descriptor
    per block instead of one per layer (K and V fused in each layer's block)."""
    outer = _demo(kv_layout="BLHNC")
    layer = _demo(kv_layout="LBNHC")
    assert outer["descriptors_per_request"] == 8
    assert layer["descriptors_per_request"] == 8 * 8


def test_consecutive_blocks_move_as_one_descriptor_per_region() -> None:
    """Consecutive local blocks reading consecutive remote blocks: one run per (layer, K/V)
    region in a layer-outer layout, bytes verified; --no-merge-runs keeps one per block."""
    merged = _demo(contiguous_blocks=True)
    assert merged["descriptors_per_request"] == 8 * 2
    plain = _demo(contiguous_blocks=True, extra_serve_args=("--no-merge-runs",))
    assert plain["descriptors_per_request"] == 8 * 2 * 8
    scattered = _demo(extra_serve_args=("--stage-below-kib", "0"))  # random block ids: nothing to merge
    # (and not staged: a staged read moves through one slot, see tests/test_tp_staged.py)
    assert scattered["descriptors_per_request"] > 8 * 2 * 4


# --------------------------------------------------------------------------- asking vLLM for it

def test_the_connector_asks_vllm_for_a_block_outermost_layout(tmp_path: object) -> None:
    """``kv_cache_layout`` in kv_connector_extra_config reaches vLLM's own layout resolution:
    taken where every backend supports it, dropped (vLLM keeps its own) where not."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    from kvxfer.connector.connector import KvxferConnector
    from kvxfer.connector.settings import ConnectorSettings
    from tests.vllm_harness import make_config, write_tiny_model

    model = write_tiny_model(str(tmp_path))
    assert KvxferConnector.get_required_kvcache_layout(make_config(model, "ipc:///tmp/none")) is None
    cfg = make_config(model, "ipc:///tmp/none", kv_cache_layout="blhnc")
    assert KvxferConnector.get_required_kvcache_layout(cfg) == "BLHNC"
    # a backend offering block-outermost layouts (vLLM's default preference order)
    assert resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC", "BLNHC", "BLHNC"]]).name == "BLHNC"
    # vLLM's CPU backend supports LBHNC only: vLLM warns and keeps it
    cpu = make_config(model, "ipc:///tmp/none", kv_cache_layout="BLHNC")
    assert resolve_kv_cache_layout(cpu, [["LBHNC"]]).name == "LBHNC"
    with pytest.raises(ValueError, match="kv_cache_layout must be one of"):
        ConnectorSettings.from_extra({"kv_cache_layout": "LHBNC"})  # heads outside the block


def test_vllm_refuses_sleep_mode_with_kvxfer_at_start_up(tmp_path: object) -> None:
    """vLLM's sleep mode frees and remaps the KV cache the sidecar mapped; not built, so the
    connector says no and vLLM's own check refuses the setting (its base connector says yes)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvxfer.connector.connector import KvxferConnector
    from tests.vllm_harness import make_config, write_tiny_model

    cfg = make_config(write_tiny_model(str(tmp_path)), "ipc:///tmp/none")
    assert KVConnectorBase_V1.supports_sleep_mode(cfg.kv_transfer_config)  # (what it inherited)
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="does not support sleep mode"):
        cfg._verify_kv_transfer_compat()
    assert not KvxferConnector.supports_sleep_mode(cfg.kv_transfer_config)


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start_up(tmp_path: object, name: str) -> None:
    """Under DCP/PCP a rank holds part of each block's tokens, which the sidecar's plans do
    not model: the connector refuses to start (both roles) rather than move tokens to other
    tokens' places (found by a review: nothing refused it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer.connector.connector import KvxferConnector
    from tests.vllm_harness import make_config, write_tiny_model

    cfg = make_config(write_tiny_model(str(tmp_path)), "ipc:///tmp/none")
    KvxferConnector(cfg, KVConnectorRole.WORKER)  # (with 1: starts; it meets its sidecar later)
    setattr(cfg.parallel_config, name, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(NotImplementedError, match=f"{name}=2: context parallelism is not supported"):
            KvxferConnector(cfg, role)


def test_merge_bound_is_zero_without_neighbouring_ids_and_open_for_a_geometry_it_does_not_know() -> None:
    nb, length = 64, 32 << 10
    geo = np.array([(r * nb * length, length, length, 0) for r in range(64)], dtype=np.int64)
    rows = [np.arange(64)]
    scattered = [(0, np.array([14, 3, 9, 40, 22]), np.array([7, 8, 30, 31, 2]))]  # 7, 8 follow: 3, 9 do not
    assert merge_bound(rows, geo, geo, scattered) == 0
    following = [(0, np.array([14, 3, 4, 40]), np.array([7, 8, 9, 2]))]  # 3 -> 4 and 8 -> 9: one pair
    assert merge_bound(rows, geo, geo, following) == 64
    odd = geo.copy()
    odd[:, 2] = length // 2  # a row longer than its stride: no bound
    assert merge_bound(rows, odd, geo, scattered) > 10**9
