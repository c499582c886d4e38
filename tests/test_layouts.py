"""The layout matrix: KV caches allocated as vLLM's attention backends allocate them (shape and
strides), registered through the connector's ``registration_from_tensors``, moved by the
sidecar's plan, every byte checked against a pattern of (request, layer, K/V, token, head,
byte) on the decode side.

Three levels: the registration's geometry per layout; a property test that executes plans
over the real tensors' memory with a byte-exact software copy (thousands of topologies in
seconds); and real sidecars moving the bytes over NIXL for every layout and topology.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import RequestError
from kvxfer.protocol import DTYPE_SIZES, RegisterKV
from kvxfer.sidecar.validate import validate_registration
from kvxfer.testing.demo import DemoOptions, run_demo
from kvxfer.testing.kept import KeptSidecars
from kvxfer.testing.tensor_kv import TensorKV
from kvxfer.testing.vllm_layouts import KINDS, Geometry
from kvxfer.topology import block_pairing, check_compatible, plan_rank

REFUSED = ("LHBNC", "BHLNC")  # heads outside the block: a layer's block is not one run
MOVABLE = [k for k in KINDS if k not in REFUSED]


def geo(**kw: object) -> Geometry:
    base = {"num_layers": 2, "num_blocks": 9, "block_size": 4, "num_kv_heads": 2, "tp_rank": 0,
            "tp_size": 1, "head_dim": 8, "dtype": "bfloat16"}
    return Geometry(**(base | kw))  # type: ignore[arg-type]


def true_block_bytes(kind: str, g: Geometry) -> int:
    """K and V of every token and local head of one block of one layer (one latent for MLA),
    computed from the sizes alone: what a region set must cover per layer and block."""
    heads = 1 if kind == "mla" else len(g.local_heads)
    return g.block_size * heads * g.head_dim * DTYPE_SIZES[g.dtype] * (1 if kind == "mla" else 2)


@pytest.mark.parametrize("kind", MOVABLE)
def test_registration_covers_exactly_the_bytes_of_each_block(kind: str) -> None:
    g = geo()
    kv = TensorKV(kind, g)
    try:
        reg = kv.register_message()
        validate_registration(reg)
        per_layer = sum(r.block_len for r in reg.regions) // g.num_layers
        assert per_layer == true_block_bytes(kind, g)
        assert all(r.block_len == reg.layout.region_block_len for r in reg.regions)
        # Fill two blocks through the logical views: exactly the regions' bytes of those
        # blocks change in memory, nothing else.
        mem = {i: np.fromfile(m.path, dtype=np.uint8) for i, m in enumerate(reg.memory)}
        kv.fill("r", [2, 5])
        after = {i: np.fromfile(m.path, dtype=np.uint8) for i, m in enumerate(reg.memory)}
        inside = {i: np.zeros(len(v), dtype=bool) for i, v in mem.items()}
        for r in reg.regions:
            for b in (2, 5):
                start = r.offset + b * r.block_stride
                inside[r.memory][start:start + r.block_len] = True
        for i in mem:
            changed = mem[i] != after[i]
            assert not (changed & ~inside[i]).any(), f"{kind}: bytes outside the regions changed"
            assert changed[inside[i]].mean() > 0.9, f"{kind}: region bytes left unwritten"
    finally:
        kv.close()


@pytest.mark.parametrize("kind", REFUSED)
def test_layouts_whose_blocks_are_not_one_run_are_refused_clearly(kind: str) -> None:
    kv = TensorKV(kind, geo())
    try:
        with pytest.raises(RequestError, match="not one contiguous run"):
            kv.register_message()
    finally:
        kv.close()


def test_a_region_whose_bytes_disagree_with_the_layout_is_refused() -> None:
    """The old fused bug from the other side: geometry stating half a block is refused."""
    import msgspec

    kv = TensorKV("LBNHC", geo())
    try:
        reg = kv.register_message()
        half = [msgspec.structs.replace(r, block_len=r.block_len // 2) for r in reg.regions]
        with pytest.raises(RequestError, match="describes"):
            validate_registration(RegisterKV(layout=reg.layout, memory=reg.memory, regions=half))
    finally:
        kv.close()


# --------------------------------------------------------------------------- property test


def _simulate(dst: TensorKV, dreg: RegisterKV, srcs: dict[int, tuple[TensorKV, RegisterKV]],
              dblocks: list[int], sblocks: list[int]) -> int:
    """Execute the sidecar's plan with a byte-exact copy between the real tensors' memory."""
    remote_any = next(iter(srcs.values()))[1].layout
    plans = plan_rank(dreg.layout, remote_any)
    pairing = block_pairing(dreg.layout, remote_any)
    dmem = {i: np.memmap(m.path, dtype=np.uint8, mode="r+") for i, m in enumerate(dreg.memory)}
    moved = 0
    for li, ri, q in pairing.pairs(len(dblocks), len(sblocks)):
        for plan in plans:
            _, sreg = srcs[plan.remote_rank]
            smem = {i: np.memmap(m.path, dtype=np.uint8, mode="r") for i, m in enumerate(sreg.memory)}
            for lreg, rreg in zip(dreg.regions, sreg.regions, strict=True):
                lbase = lreg.offset + dblocks[li] * lreg.block_stride
                rbase = rreg.offset + sblocks[ri] * rreg.block_stride
                for s in plan.segments[q]:
                    dmem[lreg.memory][lbase + s.local_off:lbase + s.local_off + s.length] = (
                        smem[rreg.memory][rbase + s.remote_off:rbase + s.remote_off + s.length])
                    moved += s.length
    for m in dmem.values():
        m.flush()
    return moved


@st.composite
def matrix(draw: st.DrawFn) -> dict[str, object]:
    pkind = draw(st.sampled_from(MOVABLE))
    compatible = {  # the decode may use another backend whose bytes mean the same
        "flash_attn": ["flash_attn", "flashinfer_nhd", "flashinfer_hnd", "triton"],
        "LBNHC": ["LBNHC", "LBHNC", "BLNHC", "BLHNC"],
    }
    group = next((g for g in compatible.values() if pkind in g), [pkind])
    dkind = draw(st.sampled_from(group))
    heads = 1 if pkind == "mla" else draw(st.sampled_from([1, 2, 4, 8]))
    ptp, dtp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    small = draw(st.sampled_from([2, 4]))
    ratio = 1 if pkind == "cpu" else draw(st.sampled_from([1, 2]))
    pbs, dbs = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    return {"pkind": pkind, "dkind": dkind, "heads": heads, "ptp": ptp, "dtp": dtp, "pbs": pbs,
            "dbs": dbs, "hd": draw(st.sampled_from([4, 8])),
            "dtype": draw(st.sampled_from(["bfloat16", "float32", "uint8"]))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(matrix())
def test_plans_over_vllm_tensors_move_every_byte_to_its_place(m: dict) -> None:  # type: ignore[type-arg]
    tokens = 2 * max(m["pbs"], m["dbs"])
    p_n, d_n = tokens // m["pbs"], tokens // m["dbs"]
    srcs: dict[int, tuple[TensorKV, RegisterKV]] = {}
    dsts: list[tuple[TensorKV, RegisterKV]] = []
    try:
        for r in range(m["ptp"]):
            kv = TensorKV(m["pkind"], geo(tp_rank=r, tp_size=m["ptp"], num_kv_heads=m["heads"],
                                          block_size=m["pbs"], head_dim=m["hd"], dtype=m["dtype"]))
            srcs[r] = (kv, kv.register_message())
            kv.fill("req", list(range(1, 1 + p_n)))
        for r in range(m["dtp"]):
            kv = TensorKV(m["dkind"], geo(tp_rank=r, tp_size=m["dtp"], num_kv_heads=m["heads"],
                                          block_size=m["dbs"], head_dim=m["hd"], dtype=m["dtype"]))
            dsts.append((kv, kv.register_message()))
        dblocks = list(range(8, 8 - d_n, -1))  # not in the prefill's order
        for kv, reg in dsts:
            check_compatible(reg.layout, srcs[0][1].layout)  # every drawn pair means the same bytes
            moved = _simulate(kv, reg, srcs, dblocks, list(range(1, 1 + p_n)))
            assert moved == d_n * true_block_bytes(m["dkind"], kv.geo) * kv.geo.num_layers
            assert kv.verify("req", dblocks), m
    finally:
        for kv, _ in [*srcs.values(), *dsts]:
            kv.close()


# --------------------------------------------------------------------------- real sidecars


def small(kind: str, **kw: object) -> DemoOptions:
    base = {"requests": 2, "layers": 2, "blocks_per_request": 2, "head_dim": 16, "block_size": 8,
            "kv_layout": kind}
    return DemoOptions(**(base | kw))  # type: ignore[arg-type]


def check(res: dict, opts: DemoOptions) -> None:
    assert res["problems"] == [], "\n".join(res["problems"])  # with the sidecars' log tails
    assert res["verified"] is True
    # every byte of K and V, per block, crossed NIXL: not half of a fused block
    assert res["bytes"] == opts.requests * opts.request_bytes()
    assert res["released"] == {"read": opts.requests + 1}


TOPOLOGIES = {
    "tp1-gqa": {"heads": 8},
    "tp2to4-decode-blocks-x2": {"prefill_tp": 2, "decode_tp": 4, "heads": 4, "decode_block_size": 16},
    "tp4to2-replicated-prefill-blocks-x2": {"prefill_tp": 4, "decode_tp": 2, "heads": 2,
                                            "prefill_block_size": 16, "blocks_per_request": 2},
    "mqa-tp1to2": {"decode_tp": 2, "heads": 1},
}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("kind", MOVABLE)
def test_real_sidecars_move_every_layout(kind: str, topology: str, kept: KeptSidecars) -> None:
    kw = dict(TOPOLOGIES[topology])
    if kind == "cpu":  # K stored transposed: no block-size ratio (refusal tested below)
        kw.pop("decode_block_size", None)
        kw.pop("prefill_block_size", None)
    opts = small(kind, **kw)
    check(run_demo(opts, kept=kept), opts)


@pytest.mark.parametrize(("pkind", "dkind"), [("flash_attn", "flashinfer_hnd"), ("triton", "flash_attn"),
                                              ("BLHNC", "LBNHC"), ("LBNHC", "BLNHC")])
def test_real_sidecars_between_backends(pkind: str, dkind: str, kept: KeptSidecars) -> None:
    opts = small(pkind, decode_kv_layout=dkind, prefill_tp=2, decode_tp=4, heads=4)
    check(run_demo(opts, kept=kept), opts)


def test_incompatible_layouts_fail_the_read_with_a_reason() -> None:
    opts = small("cpu", decode_block_size=16, requests=1, lease_s=2.0, timeout_s=10.0)
    res = run_demo(opts)
    assert res["verified"] is False
    assert any("incompatible" in p and "same block size" in p for p in res["problems"]), res["problems"]


def test_no_shared_memory_left_behind() -> None:
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"kvxfer-kv-{os.getpid()}-")]
    assert leftovers == []
