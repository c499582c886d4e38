"""Data and pipeline parallel engines sharing sidecars (#16 item 3), with real sidecar
processes, real NIXL reads over shared host memory, and every byte checked.

Ranks are keyed by (engine, DP rank, PP stage, TP rank): two DP engines of one deployment
register on one sidecar without replacing each other, a decode reads the DP engine its
request names, leases of the same request id on two DP engines stay apart, a pipeline
stage reads each layer from the remote stage that holds it, and a connection can neither
replace a live engine's rank nor unregister what it did not register.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from kvxfer.client import Drained, RemoteBlocks, SidecarClient
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import Unregister
from kvxfer.testing.engine import SyntheticEngine, make_layout, stage_layout
from kvxfer.testing.procs import SidecarFactory, free_port


def _wait_done(d: SyntheticEngine, n: int, timeout: float = 30.0) -> Drained:
    got = d.client.wait_until(lambda a: len(a.done) + len(a.failed) >= n, timeout)
    assert not got.failed, [(f.req_id, f.code, f.reason) for f in got.failed]
    assert len(got.done) == n, f"{len(got.done)} of {n} receives answered in {timeout}s"
    return got


def test_two_dp_engines_share_a_sidecar_and_each_decode_reads_the_one_it_names(
    factory: SidecarFactory,
) -> None:
    """Two prefill DP engines (TP 2 each) and two decode DP engines on one sidecar per side.
    Both prefill engines hold the *same request id* with their own bytes; each decode reads
    the other DP index (crossed, so addressing by position cannot pass). Every byte lands
    where it should and each engine's workers get only their own engine's Released."""
    ps = factory.start("pdp", "--lease-s", "30")
    ds = factory.start("ddp")
    full = make_layout(layers=3, num_blocks=48, heads=4, head_dim=32)
    prefill = {
        dp: [SyntheticEngine(make_layout(layers=3, num_blocks=48, heads=4, head_dim=32, tp_rank=tp,
                                         tp_size=2),
                             ps.endpoint, seed=10 * dp + tp, engine_id=f"pre_dp{dp}", dp_rank=dp)
             for tp in range(2)]
        for dp in range(2)
    }
    decode = {dp: SyntheticEngine(full, ds.endpoint, seed=7 + dp, engine_id=f"dec_dp{dp}", dp_rank=dp)
              for dp in range(2)}
    engines = [e for ws in prefill.values() for e in ws] + list(decode.values())
    try:
        for e in engines:
            reg = e.start()
            assert reg.engine_id == e.engine_id
            assert reg.dp_rank == e.dp_rank
        req, n = "req-shared", 6
        blocks = {}
        for dp, workers in prefill.items():
            pb = workers[0].allocate(n)
            for w in workers:
                w.fill(f"pattern-of-dp{dp}", pb)
            workers[0].client.hold(req, pb, reads=1, notify_ranks=True, engine_id=f"pre_dp{dp}")
            blocks[dp] = pb
        reg = prefill[0][0].registered
        assert reg is not None
        for ddp, d in decode.items():
            src = 1 - ddp  # crossed
            db = d.allocate(n)
            d.wipe(db)
            where = RemoteBlocks(f"pre_dp{src}", reg.handshake_host, reg.handshake_port, blocks[src],
                                 tp_size=2)
            d.client.recv(req, db, where, engine_id=f"dec_dp{ddp}")
            _wait_done(d, 1)
            assert d.verify(f"pattern-of-dp{src}", db), f"decode dp{ddp} did not get prefill dp{src}'s bytes"
            assert not d.verify(f"pattern-of-dp{ddp}", db)
            # The read released the lease of the engine it read (every worker of it), and only that.
            for w in prefill[src]:
                got = w.client.wait_until(lambda a: bool(a.released), 10.0)
                assert [(r.req_id, r.reason) for r in got.released] == [(req, "read")], (src, got.released)
            if ddp == 0:
                for w in prefill[ddp]:  # the other engine's blocks of the same request id: still held
                    assert not w.client.wait(0.3).released, "a read released another DP engine's lease"
        for workers in prefill.values():
            for w in workers:
                assert not w.client.wait(0.3).released  # each lease released exactly once
    finally:
        for e in engines:
            e.close()


def test_a_decode_naming_an_engine_the_peer_does_not_serve_gets_a_typed_error(
    factory: SidecarFactory,
) -> None:
    ps = factory.start("pone")
    ds = factory.start("done")
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=32)
    p = SyntheticEngine(lay, ps.endpoint, engine_id="pre_dp0")
    q = SyntheticEngine(lay, ps.endpoint, engine_id="pre_dp1", dp_rank=1, seed=3)
    d = SyntheticEngine(lay, ds.endpoint)
    try:
        for e in (p, q, d):
            e.start()
        pb = p.allocate(2)
        p.client.hold("r", pb, engine_id="pre_dp0")
        reg = p.registered
        assert reg is not None
        # With two engines behind the endpoint, naming neither (or the sidecar) is ambiguous.
        for name in ("pre_dp7", "pone", ""):
            where = RemoteBlocks(name, reg.handshake_host, reg.handshake_port, pb, req_id="r")
            d.client.recv(f"r-{name}", d.allocate(2), where)
            got = d.client.wait_until(lambda a: bool(a.failed or a.done), 15.0)
            assert [f.code for f in got.failed] == [ErrorCode.UNKNOWN_PEER], (name, got)
            assert "pre_dp0" in got.failed[0].reason
            assert "pre_dp1" in got.failed[0].reason
        # A hold for an engine this sidecar does not have is refused, naming what it has.
        p.client.hold("r2", pb, engine_id="nobody")
        err = p.client.wait_until(lambda a: bool(a.errors), 5.0).errors
        assert [e.code for e in err] == [ErrorCode.NOT_REGISTERED]
        assert "pre_dp0" in err[0].message
    finally:
        for e in (p, q, d):
            e.close()


@pytest.mark.parametrize(("prefill_split", "decode_split"),
                         [([2, 2], [4]), ([2, 2], [3, 1]), ([4], [1, 3])],
                         ids=["pp2-to-pp1", "pp2-to-pp2-uneven", "pp1-to-pp2"])
def test_pipeline_stages_read_each_layer_from_the_stage_that_holds_it(
    factory: SidecarFactory, prefill_split: list[int], decode_split: list[int],
) -> None:
    """Prefill and decode cut the same 4-layer model into different pipeline stages; every
    decode stage reads its layers from whichever prefill stages hold them (integrity-checked
    on the first read), and the prefill lease is released once every decode stage read."""
    ps = factory.start("ppp", "--lease-s", "30")
    ds = factory.start("dpp", metrics_port=free_port())
    model = make_layout(layers=4, num_blocks=32, heads=4, head_dim=32, head_layout="HND")
    pre = [SyntheticEngine(stage_layout(model, prefill_split, s), ps.endpoint, seed=s, engine_id="pre")
           for s in range(len(prefill_split))]
    dec = [SyntheticEngine(stage_layout(model, decode_split, s), ds.endpoint, seed=5 + s, engine_id="dec")
           for s in range(len(decode_split))]
    try:
        for e in (*pre, *dec):
            e.start()
        n = 5
        pb = pre[0].allocate(n)
        for stage in pre:
            stage.fill("pp-req", pb)
        pre[0].client.hold("pp-req", pb, notify_ranks=True, engine_id="pre")
        reg = pre[0].registered
        assert reg is not None
        db = dec[0].allocate(n)
        for stage in dec:
            stage.wipe(db)
            stage.client.recv("pp-req", db, RemoteBlocks("pre", reg.handshake_host, reg.handshake_port, pb),
                              engine_id="dec", pp_rank=stage.layout.pp_rank)
        for stage in dec:
            _wait_done(stage, 1)
            assert stage.verify("pp-req", db), f"decode stage {stage.layout.pp_rank} got wrong bytes"
        for stage in pre:  # every prefill stage's worker hears of the release, once all decode stages read
            got = stage.client.wait_until(lambda a: bool(a.released), 10.0)
            assert [(r.reason, r.reads) for r in got.released] == [("read", len(decode_split))]
        # the first read from the peer was digest-checked on both sides, per stage slice of regions
        assert ds.scrape().get('kvxfer_integrity_checks_total{result="ok"}', 0) >= 1
    finally:
        for e in (*pre, *dec):
            e.close()


def test_a_missing_pipeline_stage_is_refused_not_half_read(factory: SidecarFactory) -> None:
    ps = factory.start("pmiss")
    ds = factory.start("dmiss")
    model = make_layout(layers=4, num_blocks=16, heads=2, head_dim=32)
    stage0 = SyntheticEngine(stage_layout(model, [2, 2], 0), ps.endpoint, engine_id="pre")
    d = SyntheticEngine(model, ds.endpoint)
    try:
        stage0.start()
        d.start()
        pb = stage0.allocate(2)
        stage0.client.hold("m", pb, engine_id="pre")
        reg = stage0.registered
        assert reg is not None
        d.client.recv("m", d.allocate(2), RemoteBlocks("pre", reg.handshake_host, reg.handshake_port, pb))
        got = d.client.wait_until(lambda a: bool(a.failed or a.done), 15.0)
        assert [f.code for f in got.failed] == [ErrorCode.NOT_REGISTERED], got
        assert "1 of 2 pipeline stages" in got.failed[0].reason
    finally:
        stage0.close()
        d.close()


def _hold_rank(endpoint: str, conn: Any) -> None:
    """A child engine process: register rank 0 of engine "eng", report, then live on."""
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=32)
    eng = SyntheticEngine(lay, endpoint, engine_id="eng")
    eng.start()
    conn.send(os.getpid())
    time.sleep(120)


def test_a_connection_cannot_take_or_unregister_a_live_engines_rank(factory: SidecarFactory) -> None:
    """Ownership: the rank belongs to the process that registered it (as the kernel reports
    the connection's process, never the pid a message claims) while that process lives; a
    second registrant of the same (engine, dp, pp, tp) is refused (``rank_taken``) and
    cannot unregister it. Once the holder dies, the newcomer's registration wins."""
    import multiprocessing as mp

    sc = factory.start("own", "--engine-check-s", "0.2")
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=32)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    holder = ctx.Process(target=_hold_rank, args=(sc.endpoint, there), daemon=True)
    holder.start()
    second = SyntheticEngine(lay, sc.endpoint, engine_id="eng", seed=4)
    try:
        assert here.poll(60), "the holder did not register"
        holder_pid = here.recv()
        with pytest.raises(RequestError) as ei:
            second.start()
        assert ei.value.code == ErrorCode.RANK_TAKEN, ei.value
        assert str(holder_pid) in ei.value.reason
        second.client._send(Unregister(tp_rank=0, engine_id="eng"))
        err = second.client.wait_until(lambda a: bool(a.errors), 5.0).errors
        assert [e.code for e in err] == [ErrorCode.NOT_REGISTERED]
        # still registered to the first: a status shows one rank owned by the holder's pid
        out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", sc.control, "--json"],
                             capture_output=True, text=True, timeout=30)
        assert f'"pid": {holder_pid}' in out.stdout, out.stdout + out.stderr
        holder.kill()
        holder.join(10)
        deadline = time.monotonic() + 20
        reg = None
        while reg is None:  # the sidecar notices the holder died and drops its rank; the newcomer wins
            try:
                reg = second.start(timeout=5)
            except RequestError as e:
                if e.code != ErrorCode.RANK_TAKEN or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert reg.engine_id == "eng"
    finally:
        holder.kill()
        second.close()


def test_an_older_client_without_engine_ids_keeps_working(factory: SidecarFactory) -> None:
    """Messages without engine ids mean the sidecar's own engine (synthetic engines, tools)."""
    ps = factory.start("pold")
    ds = factory.start("dold")
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=32)
    p, d = SyntheticEngine(lay, ps.endpoint), SyntheticEngine(lay, ds.endpoint, seed=2)
    try:
        assert p.start().engine_id == "pold"
        d.start()
        pb, db = p.allocate(3), d.allocate(3)
        p.fill("o", pb)
        p.client.hold("o", pb)
        reg = p.registered
        assert reg is not None
        d.client.recv("o", db, RemoteBlocks("pold", reg.handshake_host, reg.handshake_port, pb))
        _wait_done(d, 1)
        assert d.verify("o", db)
    finally:
        p.close()
        d.close()


def test_sidecar_client_ping_is_not_confused_by_other_engines(factory: SidecarFactory) -> None:
    """Pong names the sidecar's engine; a DP rank's own id comes back in Registered."""
    sc = factory.start("pong")
    c = SidecarClient(sc.endpoint)
    try:
        assert c.ping(60).engine_id == "pong"
    finally:
        c.close()
