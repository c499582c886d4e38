"""Mamba/GDN state between different TP sizes, in pure logic: the connector's parts of a state
block (``kvxfer.connector.state_parts``) and the mapper's state plans (``kvxfer.topology``),
checked against an independent model of how vLLM shards each state over TP ranks (built here
from the model's global tensors, not from the code under test), byte by byte; and the parts
against vLLM's own state shapes. The same through real sidecars: tests/test_state_e2e.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.connector.state_parts import state_parts
from kvxfer.protocol import KVLayout, StatePart, compat_hash, compat_tp_hash, hashes_match
from kvxfer.topology import Incompatible, check_compatible, check_layout, plan_state

TPS = [1, 2, 4, 8]


@dataclass(frozen=True)
class Model:
    """A state layer of a model, whole: its conv sub-projections (channels model-wide, and the
    units they split in), its SSM state's units and bytes per unit."""

    kind: str  # mamba1 | mamba2 | gdn_attn
    subs: tuple[tuple[int, int], ...]  # (units model-wide, channels per unit) per sub-projection
    ssm_units: int
    ssm_unit_shape: tuple[int, ...]
    rows: int  # conv state rows (kernel - 1)
    ci: int = 2  # conv item size
    si: int = 4  # SSM item size

    def units_of(self, units: int, tp: int, r: int) -> range:
        """vLLM's split: even, or one unit on every rank (Mamba2's single group)."""
        if units >= tp:
            per = units // tp
            return range(r * per, (r + 1) * per)
        assert units == 1
        return range(0, 1)

    def fits(self, tp: int) -> bool:
        return all(u % tp == 0 or (u == 1 and k in (1, 2) and self.kind == "mamba2")
                   for k, (u, _c) in enumerate(self.subs)) and self.ssm_units % tp == 0

    def rank_block(self, conv: np.ndarray, ssm: np.ndarray, tp: int, r: int, dim_first: bool) -> bytes:
        """Rank r's state block, laid out as vLLM lays it: the conv state (its channels of each
        sub-projection, side by side), then the SSM state (its units)."""
        cols, at = [], 0
        for units, ch in self.subs:
            mine = self.units_of(units, tp, r)
            cols.append(conv[:, at + mine.start * ch: at + mine.stop * ch])
            at += units * ch
        local = np.concatenate(cols, axis=1)  # (rows, local dim, ci)
        if dim_first:
            local = local.transpose(1, 0, 2)
        mine = self.units_of(self.ssm_units, tp, r)
        return np.ascontiguousarray(local).tobytes() + ssm[mine.start:mine.stop].tobytes()

    def shapes(self, tp: int, dim_first: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        dim = sum(len(self.units_of(u, tp, 0)) * c for u, c in self.subs)
        conv = (dim, self.rows) if dim_first else (self.rows, dim)
        return conv, (self.ssm_units // tp, *self.ssm_unit_shape)

    def layout(self, tp: int, r: int, dim_first: bool, n_groups: int | None) -> KVLayout:
        conv, ssm = self.shapes(tp, dim_first)
        conv_bytes = conv[0] * conv[1] * self.ci
        ssm_bytes = int(np.prod(ssm)) * self.si
        parts = state_parts(self.kind, (conv, ssm), (self.ci, self.si), (0, conv_bytes), tp, dim_first,
                            n_groups)
        return KVLayout(num_layers=0, num_blocks=4, block_size=16, num_kv_heads=1, local_kv_heads=1,
                        head_dim=1, dtype="bfloat16", tp_rank=r, tp_size=tp, state_regions=2,
                        state_bytes=conv_bytes + ssm_bytes, state_parts=parts,
                        state_kind=f"{self.kind}: {conv} bfloat16 + {ssm} float32")


def mamba2(heads: int, head_dim: int, groups: int, d_state: int, rows: int = 3) -> Model:
    return Model("mamba2", ((heads, head_dim), (groups, d_state), (groups, d_state)), heads,
                 (head_dim, d_state), rows)


def gdn(k_heads: int, v_heads: int, k_dim: int, v_dim: int, rows: int = 3) -> Model:
    return Model("gdn_attn", ((k_heads, k_dim), (k_heads, k_dim), (v_heads, v_dim)), v_heads,
                 (v_dim, k_dim), rows)


def mamba1(channels: int, d_state: int, rows: int = 3) -> Model:
    return Model("mamba1", ((channels, 1),), channels, (d_state,), rows)


def global_state(m: Model, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dim = sum(u * c for u, c in m.subs)
    conv = rng.integers(0, 256, (m.rows, dim, m.ci), dtype=np.uint8)
    ssm = rng.integers(0, 256, (m.ssm_units, int(np.prod(m.ssm_unit_shape)) * m.si), dtype=np.uint8)
    return conv, ssm


def move(m: Model, p_tp: int, d_tp: int, dim_first: bool, seed: int = 0) -> None:
    """Every decode rank's state block, filled by its plans from the prefill ranks' blocks,
    equals the block vLLM would have computed at the decode's TP size."""
    conv, ssm = global_state(m, seed)
    groups = m.subs[1][0] if m.kind == "mamba2" else None
    src = [np.frombuffer(m.rank_block(conv, ssm, p_tp, r, dim_first), np.uint8) for r in range(p_tp)]
    remote = m.layout(p_tp, 0, dim_first, groups)
    for r in range(d_tp):
        local = m.layout(d_tp, r, dim_first, groups)
        assert local.state_parts
        assert remote.state_parts
        want = np.frombuffer(m.rank_block(conv, ssm, d_tp, r, dim_first), np.uint8)
        assert len(want) == local.state_bytes
        got = np.zeros_like(want)
        written = np.zeros(len(want), dtype=np.int64)
        plans = plan_state(local, remote)
        assert all(p.state and p.num_regions == 2 for p in plans)
        for plan in plans:
            (segs,) = plan.segments
            for s in segs:
                a, b = s.local_off, s.remote_off
                got[a:a + s.length] = src[plan.remote_rank][b:b + s.length]
                written[s.local_off:s.local_off + s.length] += 1
        assert (written == 1).all()
        assert np.array_equal(got, want), f"rank {r}: {p_tp} -> {d_tp} {m.kind} dim_first={dim_first}"


MODELS = [
    mamba2(heads=8, head_dim=4, groups=8, d_state=4),  # groups split over every TP
    mamba2(heads=8, head_dim=4, groups=1, d_state=4),  # one group, replicated on every rank
    mamba2(heads=16, head_dim=2, groups=2, d_state=8, rows=5),  # split at TP 2, not beyond
    gdn(k_heads=8, v_heads=16, k_dim=4, v_dim=2),
    mamba1(channels=16, d_state=4),
]


@pytest.mark.parametrize("m", MODELS, ids=lambda m: f"{m.kind}-{m.subs[1][0] if len(m.subs) > 1 else 0}")
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_every_state_byte_comes_from_the_rank_that_computed_it(m: Model, dim_first: bool) -> None:
    pairs = [(p, d) for p in TPS for d in TPS if m.fits(p) and m.fits(d)]
    assert len(pairs) >= 4
    for p, d in pairs:
        move(m, p, d, dim_first, seed=p * 10 + d)


@st.composite
def models(draw: st.DrawFn) -> Model:
    kind = draw(st.sampled_from(["mamba1", "mamba2", "gdn_attn"]))
    rows = draw(st.integers(1, 4))
    if kind == "mamba1":
        return mamba1(8 * draw(st.integers(1, 3)), draw(st.integers(1, 4)), rows)
    if kind == "mamba2":
        heads = 8 * draw(st.integers(1, 2))
        groups = draw(st.sampled_from([1, 2, 4, 8]))
        return mamba2(heads, draw(st.integers(1, 3)), groups, draw(st.integers(1, 4)), rows)
    return gdn(8, 8 * draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), rows)


@settings(max_examples=60, deadline=None)
@given(models(), st.sampled_from(TPS), st.sampled_from(TPS), st.booleans())
def test_state_plans_move_every_byte_for_any_model_and_tp_pair(m: Model, p: int, d: int,
                                                              dim_first: bool) -> None:
    if m.fits(p) and m.fits(d):
        move(m, p, d, dim_first)


def test_parts_cover_the_block_and_hash_alike_across_tp() -> None:
    m = mamba2(heads=8, head_dim=4, groups=1, d_state=4)
    a, b = m.layout(1, 0, False, 1), m.layout(4, 3, False, 1)
    check_layout(a)
    check_layout(b)
    assert compat_hash(a) != compat_hash(b)  # (the state's bytes differ with TP) ...
    assert compat_tp_hash(a) == compat_tp_hash(b) != ""  # ... what it is does not
    assert hashes_match(compat_hash(a), compat_tp_hash(a), compat_hash(b), compat_tp_hash(b))
    # a model with other groups is another model
    c = mamba2(heads=8, head_dim=4, groups=8, d_state=4).layout(4, 0, False, 8)
    assert compat_tp_hash(c) != compat_tp_hash(b)
    assert not hashes_match(compat_hash(c), compat_tp_hash(c), compat_hash(b), compat_tp_hash(b))
    with pytest.raises(Incompatible, match="state layers differ"):
        check_compatible(c, a)


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_the_byte_model_has_vllms_state_shapes(monkeypatch: pytest.MonkeyPatch, dim_first: bool) -> None:
    """The model above shards as vLLM does: its per-rank shapes are vLLM 0.33's own
    (``MambaStateShapeCalculator``, one replicated group included), in both conv layouts."""
    mu = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    monkeypatch.setattr(mu, "is_conv_state_dim_first", lambda: dim_first)
    calc = mu.MambaStateShapeCalculator
    for tp in TPS:
        for groups in (1, 8):
            m = mamba2(heads=8, head_dim=4, groups=groups, d_state=4)
            got = calc.mamba2_state_shape(tp, 32, groups, 8, 4, 4, 4)
            assert tuple(map(tuple, got)) == m.shapes(tp, dim_first)
        m = gdn(k_heads=8, v_heads=16, k_dim=4, v_dim=2)
        got = calc.gated_delta_net_state_shape(tp, 8, 16, 4, 2, 4)
        assert tuple(map(tuple, got)) == m.shapes(tp, dim_first)
        m = mamba1(channels=16, d_state=4)
        assert tuple(map(tuple, calc.mamba1_state_shape(tp, 16, 4, 4))) == m.shapes(tp, dim_first)


def test_one_group_per_rank_needs_the_models_group_count() -> None:
    """At TP 4 a rank with one group may hold the model's only group or one of four: only the
    model's config tells; without it the parts are not given (equal TP sizes only)."""
    m1, m4 = mamba2(8, 4, 1, 4), mamba2(8, 4, 4, 4)
    assert m1.shapes(4, False) == m4.shapes(4, False)
    conv, ssm = m1.shapes(4, False)
    kw = dict(itemsizes=(2, 4), offsets=(0, conv[0] * conv[1] * 2), tp_size=4, conv_dim_first=False)
    assert state_parts("MAMBA2", (conv, ssm), **kw) == ()  # type: ignore[arg-type]
    one = state_parts("MAMBA2", (conv, ssm), n_groups=1, **kw)  # type: ignore[arg-type]
    four = state_parts("MAMBA2", (conv, ssm), n_groups=4, **kw)  # type: ignore[arg-type]
    assert [p.units for p in one] == [8, 1, 1, 8]
    assert [p.units for p in four] == [8, 4, 4, 8]
    assert state_parts("MAMBA2", (conv, ssm), n_groups=2, **kw) == ()  # type: ignore[arg-type]
    assert state_parts("short_conv", (conv, ssm), n_groups=1, **kw) == ()  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "reason"), [
    (dict(state_parts=()), "needs both sides to say how it splits"),
    (dict(state_regions=3), "state_regions differs"),
])
def test_state_between_tp_sizes_is_refused_without_parts_or_other_layers(change: dict, reason: str) -> None:
    import msgspec

    m = mamba2(heads=8, head_dim=4, groups=8, d_state=4)
    local, remote = m.layout(2, 0, True, 8), m.layout(4, 0, True, 8)
    check_compatible(local, remote)
    with pytest.raises(Incompatible, match=reason):
        plan_state(local, msgspec.structs.replace(remote, **change))


@pytest.mark.parametrize(("parts", "reason"), [
    ((StatePart(0, 1, 0, 8, 16),), "cover 64 of 256"),
    ((StatePart(0, 1, 0, 8, 16), StatePart(40, 1, 0, 8, 16)), "overlap"),
    ((StatePart(0, 1, 0, 3, 16),), "cannot be split over TP 2"),
    ((StatePart(0, 5000, 0, 8, 16),), "more than 4096 runs"),
])
def test_bad_state_parts_are_refused(parts: tuple[StatePart, ...], reason: str) -> None:
    lay = KVLayout(num_layers=0, num_blocks=4, block_size=16, num_kv_heads=1, local_kv_heads=1, head_dim=1,
                   dtype="bfloat16", tp_rank=0, tp_size=2, state_regions=1, state_bytes=256,
                   state_kind="mamba2", state_parts=parts)
    with pytest.raises(Incompatible, match=reason):
        check_layout(lay)


def test_an_off_by_one_unit_plan_is_caught() -> None:
    """The check the e2e test's break relies on: a plan reading one unit too far is refused,
    and the byte model sees the wrong bytes."""
    import kvxfer.topology as topo

    m = mamba2(heads=8, head_dim=4, groups=8, d_state=4)
    orig = topo.heads_of
    try:
        topo.heads_of = lambda h, t, r: orig(h, t, (r + 1) % t)  # type: ignore[assignment]
        with pytest.raises((AssertionError, Incompatible)):
            move(m, 2, 4, True)
    finally:
        topo.heads_of = orig


def test_state_dtypes_are_part_of_what_must_match_across_tp() -> None:
    """fp16 and bf16 states have the same bytes a unit; the TP-independent match tells them
    apart by the dtypes the state kind names (found by review)."""
    import msgspec

    m = mamba2(heads=8, head_dim=4, groups=8, d_state=4)
    a, b = m.layout(2, 0, False, 8), m.layout(4, 0, False, 8)
    fp16 = msgspec.structs.replace(b, state_kind=b.state_kind.replace("bfloat16", "float16"))
    assert compat_tp_hash(a) == compat_tp_hash(b) != compat_tp_hash(fp16)
    with pytest.raises(Incompatible, match="state layers differ"):
        check_compatible(a, fp16)


def test_a_peer_of_too_many_ranks_is_refused() -> None:
    """Planning against a peer's layout costs work in its TP size: a bound (found by review)."""
    import msgspec

    lay = mamba2(heads=8, head_dim=4, groups=1, d_state=4).layout(2, 0, False, 1)
    with pytest.raises(Incompatible, match="more than 4096 ranks"):
        check_layout(msgspec.structs.replace(lay, tp_size=1 << 20))


def test_a_peers_rank_must_match_ours_as_the_handshake_did() -> None:
    """A rank the peer advertises hashes to its own compat_hash and matches the dialer's hashes
    as the handshake did: a TP-independent hash that its ranks do not bear is refused (found by
    review: a peer's Welcome.compat_tp is not under the MAC)."""
    import msgspec

    from kvxfer.errors import RequestError
    from kvxfer.protocol import RankInfo, RemoteRegion
    from kvxfer.sidecar.validate import validate_rank_info

    m = mamba2(heads=8, head_dim=4, groups=8, d_state=4)
    ours, theirs = m.layout(2, 0, False, 8), m.layout(4, 1, False, 8)
    regions = [RemoteRegion(addr=(1 << 20) * (i + 1), block_len=theirs.state_bytes,
                            block_stride=theirs.state_bytes) for i in range(theirs.state_regions)]
    info = RankInfo(layout=theirs, regions=regions)
    mine = (compat_hash(ours), compat_tp_hash(ours))
    validate_rank_info(info, compat_hash(theirs), mine)  # (the same model at another TP size)
    other = msgspec.structs.replace(theirs, state_kind=theirs.state_kind.replace("bfloat16", "float16"))
    with pytest.raises(RequestError, match="compatibility hashes"):
        validate_rank_info(RankInfo(layout=other, regions=regions), compat_hash(other), mine)


def test_the_signature_in_kv_transfer_params_is_the_same_at_any_tp_size() -> None:
    """What a prefill tells a decode of another TP size (remote_state_split): equal for the same
    model at every TP size, different for another conv layout, dtype or group count."""
    from kvxfer.connector.state_parts import StateSplit

    def sig(tp: int, dim_first: bool = False, groups: int = 8, dtypes: tuple[str, ...] = ("bf16",)) -> str:
        shapes = mamba2(heads=8, head_dim=4, groups=groups, d_state=4).shapes(tp, dim_first)
        return StateSplit("mamba2", shapes, (2, 4), tp, dim_first, groups, dtypes).signature()

    assert sig(1) == sig(2) == sig(4) == sig(8) != ""
    assert sig(2, dim_first=True) != sig(2)
    assert sig(2, dtypes=("fp16",)) != sig(2)
    assert sig(2, groups=1) != sig(2)
    assert StateSplit("short_conv", ((3, 8),), (2,), 2, False).signature() == ""
