"""Push mode on real sidecars (#36): the decode reads a request's layers while its prefill
computes them (``kvxfer.sidecar.layer_stream``), real NIXL transfers on shared host memory,
every byte checked.

The synthetic prefill engine holds its blocks before computing (``Hold.streamed``), writes
one layer at a time and reports it (``LayersDone``); the decode's Recv is sent at the same
moment (``Recv.streamed``: the router dispatched to both at once; it knows only the transfer
id). The decode's blocks hold the first layers before the prefill has computed the last ones:
the bytes moved while the prefill computed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvxfer.client import RemoteBlocks
from kvxfer.errors import ErrorCode
from kvxfer.protocol import Cancel, KVLayout, LayersDone
from kvxfer.sidecar.stream_feed import WATCH_WAIT_S
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.pattern import request_pattern
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port
from tests.test_sidecar import wait_for

LAYOUT = make_layout(layers=16, num_blocks=64, heads=4, head_dim=64)  # 256 KiB per block
# (both sidecars with a host staging arena, staging whatever a read's descriptors)
STAGED = ("--staging-mib", "16", "--stage-min-descs", "1", "--stage-below-kib", "1024")


def streamed_remote(p: SyntheticEngine, transfer_id: str) -> RemoteBlocks:
    """What a router that dispatched to both at once knows: the prefill sidecar's address,
    the transfer id (also the request's capability); not its blocks."""
    reg = p.registered
    assert reg is not None
    return RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [], req_id=transfer_id,
                        token=transfer_id)


Pair = tuple[SidecarProc, SidecarProc, SyntheticEngine, SyntheticEngine]


@contextlib.contextmanager
def pair(sidecars: SidecarFactory, name: str, *decode_args: str, metrics: bool = False,
         prefill_args: tuple[str, ...] = (), layout: KVLayout = LAYOUT) -> Iterator[Pair]:
    """A decode and a prefill sidecar (``<name>-d``, ``<name>-p``), an engine registered with
    each; the engines are closed on leaving."""
    ds = sidecars.start(f"{name}-d", "--verify-sample", "0", *decode_args,
                        **({"metrics_port": free_port()} if metrics else {}))
    ps = sidecars.start(f"{name}-p", *prefill_args)
    d, p = SyntheticEngine(layout, ds.endpoint, seed=2), SyntheticEngine(layout, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        yield ds, ps, d, p
    finally:
        d.close()
        p.close()


def stream(p: SyntheticEngine, d: SyntheticEngine, tid: str, pb: list[int], db: list[int],
           deadline_s: float = 30) -> None:
    """The router's push dispatch: the prefill holds before computing, the decode follows."""
    p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
    d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=deadline_s)


def compute(p: SyntheticEngine, tid: str, blocks: list[int], layers: range, pause_s: float = 0.0) -> None:
    """The prefill computes these layers one by one, reporting each."""
    for layer in layers:
        p.fill_layers(tid, blocks, range(layer, layer + 1))
        p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
        if pause_s:
            time.sleep(pause_s)


def stream_ranks(ps_eng: list[SyntheticEngine], ds_eng: list[SyntheticEngine],
                 tid: str) -> tuple[list[int], list[int]]:
    """Push dispatch between TP sizes: every rank of each side allocates the same 3 block ids
    (as vLLM's ranks do), the prefill holds them streamed, every decode rank follows."""
    pb, db = ps_eng[0].allocate(3), ds_eng[0].allocate(3)
    for e in ps_eng[1:]:
        assert e.allocate(3) == pb
    for e in ds_eng[1:]:
        assert e.allocate(3) == db
    ps_eng[0].client.hold(tid, pb, token=tid, streamed=True, notify_ranks=True, expires_unix=time.time() + 60)
    for r, e in enumerate(ds_eng):
        e.client.recv(tid, db, streamed_remote(ps_eng[0], tid), tp_rank=r, streamed=True, deadline_s=30)
    return pb, db


def every_rank_verified(ps_eng: list[SyntheticEngine], ds_eng: list[SyntheticEngine], tid: str,
                        db: list[int]) -> None:
    """Every decode rank's load done with the prefill's bytes; the prefill's lease released."""
    for e in ds_eng:
        got = wait_for(e.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got
        assert e.verify(tid, db), f"decode rank {e.layout.tp_rank}: bytes differ"
    wait_for(ps_eng[0].client, lambda a: bool(a.released))


def test_a_streamed_request_is_read_while_its_prefill_computes(sidecars: SidecarFactory) -> None:
    with pair(sidecars, "push", metrics=True) as (ds, ps, d, p):
        for i in range(3):
            tid = f"push-{i}"
            pb, db = p.allocate(8), d.allocate(8)
            p.wipe(pb)
            d.wipe(db)
            if i == 1:  # the decode asks first: the prefill's Hold is not there yet
                d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
                time.sleep(0.05)
                p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
            else:
                stream(p, d, tid, pb, db)
            compute(p, tid, pb, range(0, 10), pause_s=0.02)
            # before the last layers are computed, the first ones are in the decode's blocks
            deadline = time.monotonic() + 10
            while not d.verify_layers(tid, db, range(0, 8)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.verify_layers(tid, db, range(0, 8)), "the computed layers did not move meanwhile"
            assert not d.client.poll().done  # (not done: layers 10-15 are not computed yet)
            compute(p, tid, pb, range(10, 16))
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert got.done, got
            assert got.done[0].nbytes == 8 * LAYOUT.num_layers * 2 * LAYOUT.region_block_len
            assert d.verify(tid, db), "bytes differ after the stream"
            wait_for(p.client, lambda a: bool(a.released))
            d.free(db)
            p.free(pb)
        assert ds.proc.poll() is None
        assert ps.proc.poll() is None


def test_a_prefill_that_aborts_mid_stream_fails_the_load(sidecars: SidecarFactory) -> None:
    """The prefill engine drops the request after some layers (its lease ends): the decode's
    load fails ``expired`` with every block it was to fill (vLLM recomputes them)."""
    with pair(sidecars, "pusha") as (ds, ps, d, p):
        tid = "push-abort"
        pb, db = p.allocate(4), d.allocate(4)
        stream(p, d, tid, pb, db)
        compute(p, tid, pb, range(0, 5))
        time.sleep(0.1)
        p.client.release(tid)
        released = time.monotonic()
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        # told when the lease ended, not when its watch's wait (5 s) ran out
        assert time.monotonic() - released < WATCH_WAIT_S / 2
        assert got.failed, got
        assert got.failed[0].code == ErrorCode.EXPIRED
        assert sorted(got.failed[0].block_ids) == sorted(db)
        assert ds.proc.poll() is None


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_decode_that_cancels_mid_stream_stops_at_once_and_releases_the_prefill(
        sidecars: SidecarFactory, staged: bool) -> None:
    """The decode engine drops the request while its load follows the prefill (``Cancel``: a
    client gone): the load fails ``cancelled`` at once, not at its deadline; no byte lands in
    its blocks after that, however many layers the prefill computes next; and the prefill's
    lease ends ``aborted`` now (its engine frees the blocks when it finishes computing).
    ``staged``: the pre-reads go through both sidecars' staging arenas."""
    args = STAGED if staged else ()
    with pair(sidecars, "pushcs" if staged else "pushc", *args, prefill_args=args) as (ds, ps, d, p):
        tid = "push-cancel"
        pb, db = p.allocate(4), d.allocate(4)
        d.wipe(db)
        stream(p, d, tid, pb, db, deadline_s=30)
        compute(p, tid, pb, range(0, 5))
        end = time.monotonic() + 10
        while not d.verify_layers(tid, db, range(0, 5)):  # (the first layers were read meanwhile)
            assert time.monotonic() < end, "the computed layers never moved"
            time.sleep(0.01)
        time.sleep(0.3)  # (their pre-read settled: the load waits on its next watch, nothing in flight)
        d.client.send(Cancel(req_id=tid))
        sent = time.monotonic()
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert time.monotonic() - sent < 5, "the cancel waited for the load's deadline"
        assert got.failed, got
        assert not got.done, got
        assert got.failed[0].code == ErrorCode.CANCELLED
        assert sorted(got.failed[0].block_ids) == sorted(db)
        d.wipe(db)  # the engine reuses the blocks at once
        rel = wait_for(p.client, lambda a: bool(a.released), timeout=5)
        assert [(r.req_id, r.reason) for r in rel.released] == [(tid, "aborted")]
        compute(p, tid, pb, range(5, LAYOUT.num_layers))  # the prefill goes on computing
        time.sleep(0.5)
        assert not d.verify_layers(tid, db, range(5, 6)), "a layer computed after the cancel was read"
        assert not d.kv.blocks()[:, :, db, :].any(), "bytes landed in the cancelled load's blocks"  # type: ignore[union-attr]
        assert d.client.poll().done == []
        # The transfer id again (a router's retry): the layers reported after the lease ended
        # do not count for the new hold, whose blocks nobody computed (read, they would be).
        pb2, db2 = p.allocate(4), d.allocate(4)
        p.client.hold(tid, pb2, token=tid, streamed=True, expires_unix=time.time() + 60)
        d.client.recv("retry", db2, streamed_remote(p, tid), streamed=True, deadline_s=2)  # (the decode's
        # own id is new: the cancelled one's are refused for a few seconds)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert not got.done, "layers reported for the ended lease were read as the new hold's"
        assert got.failed[0].code == ErrorCode.DEADLINE
        assert ds.proc.poll() is None
        assert ps.proc.poll() is None


def test_a_decode_that_cancels_before_the_prefill_holds_still_releases_it(sidecars: SidecarFactory) -> None:
    """The decode cancels while the prefill's sidecar does not hold the request yet (the
    prefill engine had not scheduled it): its "will not read" is kept there, and the Hold that
    comes later is released ``aborted`` at once, not held for its lease."""
    with pair(sidecars, "pushe") as (ds, ps, d, p):
        tid = "push-cancel-early"
        pb, db = p.allocate(4), d.allocate(4)
        d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
        time.sleep(0.5)  # (handshaked: it watches a request the prefill does not hold)
        d.client.send(Cancel(req_id=tid))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=10)
        assert got.failed[0].code == ErrorCode.CANCELLED
        time.sleep(0.5)  # (its "will not read" reached the prefill's sidecar before the Hold)
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
        rel = wait_for(p.client, lambda a: bool(a.released), timeout=5)
        assert [(r.req_id, r.reason) for r in rel.released] == [(tid, "aborted")]
        compute(p, tid, pb, range(0, LAYOUT.num_layers))  # (its engine computes on: nothing breaks)
        assert ds.proc.poll() is None
        assert ps.proc.poll() is None


def test_a_cancel_that_overtakes_its_recv_refuses_it(sidecars: SidecarFactory) -> None:
    """A Cancel that finds no receive (its Recv still on the way: a large one crosses ZMQ, the
    Cancel the engine ring) refuses the request's Recvs for a few seconds: the aborted load is
    never read (vLLM may have freed its blocks once the load is reported), it fails at once."""
    with pair(sidecars, "pushf") as (ds, ps, d, p):
        pb, db = p.allocate(2), d.allocate(2)
        p.fill("pull-late", pb)
        p.client.hold("pull-late", pb, token="tk")
        d.wipe(db)
        d.client.send(Cancel(req_id="pull-late"))
        time.sleep(0.2)
        reg = p.registered
        assert reg is not None
        d.client.recv("pull-late", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                                    token="tk"), deadline_s=30)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=10)
        assert not got.done, "a load its engine cancelled first was read"
        assert got.failed[0].code == ErrorCode.EXPIRED
        assert not d.verify("pull-late", db)


def test_a_prefill_that_never_finishes_fails_the_load_at_its_deadline(sidecars: SidecarFactory) -> None:
    with pair(sidecars, "pushd") as (ds, ps, d, p):
        tid = "push-stuck"
        pb, db = p.allocate(4), d.allocate(4)
        stream(p, d, tid, pb, db, deadline_s=2)
        compute(p, tid, pb, range(0, 3))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.failed, got
        assert got.failed[0].code == ErrorCode.DEADLINE
        assert ds.proc.poll() is None


def test_a_decode_with_a_partial_prefix_hit_reads_the_suffix(sidecars: SidecarFactory) -> None:
    """The decode holds the first blocks of the prompt already (its prefix cache): it asks for
    fewer blocks, and they are filled with the prefill's last blocks, nothing shifted."""
    with pair(sidecars, "pushs") as (ds, ps, d, p):
        tid = "push-suffix"
        pb, db = p.allocate(5), d.allocate(2)
        stream(p, d, tid, pb, db)
        compute(p, tid, pb, range(0, LAYOUT.num_layers))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got
        want = request_pattern(LAYOUT, tid, 5)[:, :, 3:5, :]
        assert d.kv is not None
        assert np.array_equal(d.kv.blocks()[:, :, np.asarray(db), :], want), "not the prefill's last blocks"


def test_watches_waiting_at_a_prefill_take_no_listener_slot(sidecars: SidecarFactory) -> None:
    """More decodes watch than the listener answers at once (64): they wait in the stream
    server, and a handshake and a pull read from another decode still go through."""
    lay = make_layout(layers=2, num_blocks=128, heads=2, head_dim=16)
    ds, ds2 = sidecars.start("pushw-d", "--verify-sample", "0"), sidecars.start("pushw-d2")
    ps = sidecars.start("pushw-p")
    d, d2, p = (SyntheticEngine(lay, s.endpoint, seed=i) for i, s in enumerate((ds, ds2, ps)))
    try:
        for e in (d, d2, p):
            e.start()
        n = 70
        for i in range(n):
            tid = f"pushw-{i}"
            stream(p, d, tid, p.allocate(1), d.allocate(1))
        time.sleep(1.0)  # (every watch waits at the prefill: nothing is computed)
        pb, db = p.allocate(2), d2.allocate(2)
        p.fill("pull", pb)
        p.client.hold("pull", pb, token="tok-pull", expires_unix=time.time() + 60)
        reg = p.registered
        assert reg is not None
        d2.client.recv("pull", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                                token="tok-pull"), deadline_s=10)
        got = wait_for(d2.client, lambda a: bool(a.done or a.failed), timeout=10)
        assert got.done, got
        assert d2.verify("pull", db)
        for i in range(n):
            p.client.release(f"pushw-{i}")
        got = wait_for(d.client, lambda a: len(a.failed) >= n, timeout=20)
        assert {f.code for f in got.failed} == {ErrorCode.EXPIRED}
    finally:
        for e in (d, d2, p):
            e.close()


def test_a_prefill_sidecar_killed_mid_stream_fails_the_load_before_its_deadline(
        sidecars: SidecarFactory) -> None:
    """The prefill's sidecar dies while the decode follows it: the load fails (vLLM recomputes)
    long before its deadline, every block named, and the decode's sidecar goes on serving."""
    with pair(sidecars, "pushk", "--handshake-timeout-s", "2") as (ds, ps, d, p):
        tid = "push-killed"
        pb, db = p.allocate(4), d.allocate(4)
        stream(p, d, tid, pb, db, deadline_s=60)
        compute(p, tid, pb, range(0, 5))
        time.sleep(0.2)
        ps.proc.kill()
        killed = time.monotonic()
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        assert got.failed, got
        assert sorted(got.failed[0].block_ids) == sorted(db)
        print(f"\nfailed {time.monotonic() - killed:.1f} s after the kill: [{got.failed[0].code}] "
              f"{got.failed[0].reason}")
        assert time.monotonic() - killed < 8  # (--peer-stall-s 2; a watch alone waits 10 s)
        assert ds.proc.poll() is None


def test_a_decode_sidecar_killed_mid_stream_lets_the_prefill_free_its_blocks(
        sidecars: SidecarFactory) -> None:
    """The decode's sidecar dies while it follows a stream: no watch renews the prefill's
    lease any more, so it ends at its time (``Released``: the prefill engine frees the blocks,
    never sooner while reads could run) and the prefill serves the next decode as before."""
    with pair(sidecars, "pushdk") as (ds, ps, d, p):
        tid = "push-decode-killed"
        pb, db = p.allocate(4), d.allocate(4)
        p.client.hold(tid, pb, lease_s=2, token=tid, streamed=True, expires_unix=time.time() + 60)
        d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=60)
        compute(p, tid, pb, range(0, 5))
        deadline = time.monotonic() + 10
        while not d.verify_layers(tid, db, range(0, 5)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.verify_layers(tid, db, range(0, 5)), "the decode was not following the stream"
        ds.proc.kill()
        killed = time.monotonic()
        assert not p.client.poll().released  # (not at once: it was being read)
        got = wait_for(p.client, lambda a: any(r.req_id == tid for r in a.released), timeout=20)
        print(f"\nreleased {time.monotonic() - killed:.1f} s after the decode's sidecar was killed")
        assert [r.req_id for r in got.released] == [tid]
        assert time.monotonic() - killed < 2 + WATCH_WAIT_S  # (its lease, renewed by the last watch)
        ds2 = sidecars.start("pushdk-d2", "--verify-sample", "0")
        d2 = SyntheticEngine(LAYOUT, ds2.endpoint, seed=3)
        try:
            d2.start()
            tid2, db2 = "push-after", d2.allocate(4)
            stream(p, d2, tid2, pb, db2)
            compute(p, tid2, pb, range(LAYOUT.num_layers))
            done = wait_for(d2.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert done.done, done
            assert d2.verify(tid2, db2)
        finally:
            d2.close()
        assert ps.proc.poll() is None


def test_a_watch_that_comes_before_its_hold_waits_for_it(sidecars: SidecarFactory) -> None:
    """The decode asks before the prefill holds (dispatched first; a prompt computed in chunks
    is held only once it finished, as pull holds it): its watch waits at the prefill for the
    Hold and is answered by it (well before its 5 s wait ends), not asked again and again (it
    used to be, every 2 ms backing off to 100 ms: 10 and more watches over a second). Both a
    plain Hold (every layer ready) and a streamed one (the layers follow)."""
    ds = sidecars.start("pushlh-d", "--verify-sample", "0")
    ps = sidecars.start("pushlh-p", metrics_port=free_port())
    d, p = SyntheticEngine(LAYOUT, ds.endpoint, seed=2), SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        for streamed in (False, True):
            before = ps.scrape().get('kvxfer_push_watches_total{held="no"}', 0.0)
            tid = f"push-late-hold-{streamed}"
            pb, db = p.allocate(4), d.allocate(4)
            d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
            time.sleep(1.0)
            assert not d.client.poll().done
            held = time.monotonic()
            if streamed:
                p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
                compute(p, tid, pb, range(LAYOUT.num_layers))
            else:  # (computed in chunks, held whole once finished: every layer ready)
                p.fill(tid, pb)
                p.client.hold(tid, pb, token=tid, expires_unix=time.time() + 60)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=20)
            assert got.done, got
            assert d.verify(tid, db)
            # answered by the Hold: its parked wait (4 s left) did not run out first
            assert time.monotonic() - held < 2.5
            early = ps.scrape().get('kvxfer_push_watches_total{held="no"}', 0.0) - before
            assert early == 1, f"{early} watches asked before the hold"
            wait_for(p.client, lambda a, t=tid: any(r.req_id == t for r in a.released))
            d.free(db)
            p.free(pb)
    finally:
        d.close()
        p.close()


def test_a_decode_that_reads_nothing_releases_the_prefill(sidecars: SidecarFactory) -> None:
    """A decode with a full local prefix hit, or one whose request was aborted before it got
    blocks, sends an empty streamed Recv (the connector's ``_release_remote``): the prefill's
    lease ends as soon as its layers are computed (not at its expiry: ``lease_s`` 30), and
    the decode's engine gets a ``Done`` of nothing."""
    with pair(sidecars, "pushe") as (ds, ps, d, p):
        tid = "push-empty"
        pb = p.allocate(4)
        p.client.hold(tid, pb, lease_s=30, token=tid, streamed=True, expires_unix=time.time() + 60)
        d.client.recv(tid, [], streamed_remote(p, tid), streamed=True, deadline_s=30)
        compute(p, tid, pb, range(LAYOUT.num_layers))
        done = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=20)
        assert done.done, done
        assert done.done[0].nbytes == 0
        released = time.monotonic()
        wait_for(p.client, lambda a: any(r.req_id == tid for r in a.released), timeout=10)
        assert time.monotonic() - released < 5


@pytest.mark.parametrize(("kind", "ptp", "dtp"), [("HND", 2, 4), ("HND", 4, 1), ("NHD", 2, 4), ("MLA", 1, 2),
                                                  ("block-outermost", 2, 2)])
def test_push_between_different_tp_sizes(sidecars: SidecarFactory, kind: str, ptp: int, dtp: int) -> None:
    """Each decode rank follows the prefill and reads its head slice from the prefill ranks
    that hold it (pull's TP plans, cut to layers); a layer is ready once every prefill rank
    computed it (the ranks here compute one after the other). Every byte of every decode rank
    checked; shown failing with a layer counted ready when rank 0 computed it."""
    name = f"{kind[:3].lower()}{ptp}{dtp}"
    ds = sidecars.start(f"pusht-d{name}", "--verify-sample", "0")
    ps = sidecars.start(f"pusht-p{name}")
    lay = {"layers": 8, "num_blocks": 32, "heads": 4, "head_dim": 32, "mla": kind == "MLA",
           "head_layout": "NHD" if kind == "NHD" else "HND"}
    outer = kind == "block-outermost"

    def engines(sc: Any, tp: int, seed: int) -> list[SyntheticEngine]:
        return [SyntheticEngine(make_layout(tp_size=tp, tp_rank=r, **lay), sc.endpoint, seed=seed,  # type: ignore[arg-type]
                                block_outer=outer) for r in range(tp)]

    ds_eng, ps_eng = engines(ds, dtp, 7), engines(ps, ptp, 3)
    try:
        for e in (*ds_eng, *ps_eng):
            e.start()
        tid = f"push-tp-{name}"
        pb, db = stream_ranks(ps_eng, ds_eng, tid)
        for r, e in enumerate(ps_eng):  # (rank after rank: the last lags the others by far)
            for layer in range(8):
                e.fill_layers(tid, pb, range(layer, layer + 1))
                e.client.send(LayersDone(req_ids=[tid], layers=layer + 1, tp_rank=r))
            time.sleep(0.2)
        every_rank_verified(ps_eng, ds_eng, tid, db)
    finally:
        for e in (*ds_eng, *ps_eng):
            e.close()


@pytest.mark.parametrize("torch_copies", [False, True], ids=["host-copies", "torch-copies"])
def test_pre_reads_are_staged_as_pull_reads_are(sidecars: SidecarFactory, torch_copies: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-read (the layers computed so far) is staged as a pull read is: the prefill copies
    their runs into its arena, one read of that slot, the scatter here. On a GPU that is the
    only fast lane (a direct read of the engine's VRAM crawls over tcp: README "GPU paths"),
    and push's pre-reads used to go direct. NHD 2 -> 4 (a head slice: one descriptor per token
    per layer directly); ``torch-copies`` runs VRAM staging's copy routines on host memory.
    Every byte checked; the decode's metrics count the staged reads: more than the final ones."""
    if torch_copies:
        monkeypatch.setenv("KVXFER_TEST_TORCH_COPIES", "1")
    name = "tc" if torch_copies else "hc"
    ds = sidecars.start(f"pushs-d{name}", "--verify-sample", "0", *STAGED, metrics_port=free_port())
    ps = sidecars.start(f"pushs-p{name}", *STAGED, metrics_port=free_port())
    lay = {"layers": 8, "num_blocks": 32, "heads": 4, "head_dim": 32, "head_layout": "NHD"}
    ds_eng = [SyntheticEngine(make_layout(tp_size=4, tp_rank=r, **lay), ds.endpoint, seed=7)  # type: ignore[arg-type]
              for r in range(4)]
    ps_eng = [SyntheticEngine(make_layout(tp_size=2, tp_rank=r, **lay), ps.endpoint, seed=3)  # type: ignore[arg-type]
              for r in range(2)]
    try:
        for e in (*ds_eng, *ps_eng):
            e.start()
        tid = f"push-staged-{name}"
        pb, db = stream_ranks(ps_eng, ds_eng, tid)
        for layer in range(8):  # (both prefill ranks compute each layer, then a pause: pre-reads)
            for r, e in enumerate(ps_eng):
                e.fill_layers(tid, pb, range(layer, layer + 1))
                e.client.send(LayersDone(req_ids=[tid], layers=layer + 1, tp_rank=r))
            if layer == 3:  # (the first half in every decode rank's blocks before the rest is computed)
                end = time.monotonic() + 20
                while not all(e.verify_layers(tid, db, range(0, 4)) for e in ds_eng):
                    assert time.monotonic() < end, "the computed layers never moved"
                    time.sleep(0.01)
            time.sleep(0.05)
        every_rank_verified(ps_eng, ds_eng, tid, db)
        m = ds.scrape()
        staged, direct = m['kvxfer_staged_receives{how="slot"}'], m['kvxfer_staged_receives{how="direct"}']
        assert direct == 0, m
        assert staged > len(ds_eng), m  # (every rank's final read, and pre-reads before it)
        # the prefill's cost of its answers (a request may serve several ranks' reads)
        pm = ps.scrape()
        assert 0 < pm["kvxfer_staged_answers"] <= staged, pm
        assert pm["kvxfer_staged_answer_seconds"] >= pm["kvxfer_staged_gather_seconds"] > 0, pm
    finally:
        for e in (*ds_eng, *ps_eng):
            e.close()


def test_a_stream_that_fails_after_a_staged_pre_read_frees_the_prefills_slot(
        sidecars: SidecarFactory) -> None:
    """The prefill aborts after a staged pre-read landed: the load fails, and the slot the
    prefill's arena kept for that reader is freed at once (the decode tells the prefill),
    not at its expiry ~30 s on (on a GPU, other reads found that arena full meanwhile and went
    directly). Found by review; shown failing without the notice."""
    ds = sidecars.start("pushsf-d", "--verify-sample", "0", *STAGED)
    ps = sidecars.start("pushsf-p", *STAGED, metrics_port=free_port())
    d, p = SyntheticEngine(LAYOUT, ds.endpoint, seed=2), SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        tid = "push-staged-fail"
        pb, db = p.allocate(4), d.allocate(4)
        stream(p, d, tid, pb, db, deadline_s=30)
        compute(p, tid, pb, range(0, 5))
        end = time.monotonic() + 10
        while not d.verify_layers(tid, db, range(0, 5)):
            assert time.monotonic() < end, "the computed layers never moved"
            time.sleep(0.01)
        assert ps.scrape()["kvxfer_staging_slots"] == 1  # (the pre-read's, kept for its reader)
        p.client.release(tid)  # the prefill aborts the request
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.failed, got
        end = time.monotonic() + 5
        while ps.scrape()["kvxfer_staging_slots"] and time.monotonic() < end:
            time.sleep(0.05)
        assert ps.scrape()["kvxfer_staging_slots"] == 0, "the pre-read's slot outlived the failed stream"
    finally:
        d.close()
        p.close()


def test_a_rank_that_registers_again_fails_its_receives_that_wait(sidecars: SidecarFactory) -> None:
    """A receive asked for into a rank's memory that waits (here: following a prefill that has
    not computed it) when that rank registers again is failed ``not_registered`` then: it was
    asked for into the old memory, and is never read into the new registration's (the same
    block ids there may be another request's). Found by a review: only leases and reads
    already posted ended then, so this load read on into the new memory once computed."""
    with pair(sidecars, "pushg") as (ds, ps, d, p):
        tid = "push-reregistered"
        pb, db = p.allocate(4), d.allocate(4)
        d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
        time.sleep(0.5)  # (handshaked: it watches a request the prefill does not hold yet)
        again = d.kv.register_message()  # the rank registers again (the same process and memory
        # channel: its pools are not handed back as after a sidecar restart, which ends its receives anyway)
        assert again is not None
        d.client.register(msgspec.structs.replace(again, engine_id=d.engine_id, dp_rank=d.dp_rank), 10.0)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=5)
        assert not got.done, "a receive asked for into the old registration was read into the new one"
        assert got.failed, "the receive waited on after its rank registered again"
        assert got.failed[0].code == ErrorCode.NOT_REGISTERED
        d.wipe(db)
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
        compute(p, tid, pb, range(0, LAYOUT.num_layers))
        late = d.client.wait_until(lambda a: bool(a.done or a.failed), 3.0)  # (nothing more comes)
        assert not late.done
        assert not d.verify(tid, db), "the prefill's bytes landed in the re-registered memory"
        assert ds.proc.poll() is None


def test_reports_before_a_refused_streamed_hold_do_not_count_for_a_retry(sidecars: SidecarFactory) -> None:
    """Layer reports that come before their streamed Hold are kept for it. A Hold refused (here:
    too late, its engine's deadline past) or released at once never started its book, so they
    stayed, and the router's retry held under the same transfer id started with every layer
    "computed": its decode read blocks nothing had computed, proven by the retry's own lease
    word (found by a review)."""
    with pair(sidecars, "pushh") as (ds, ps, d, p):
        tid = "push-refused"
        pb = p.allocate(4)
        p.client.send(LayersDone(req_ids=[tid], layers=LAYOUT.num_layers))  # (its workers reported)
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() - 5)
        err = wait_for(p.client, lambda a: bool(a.errors), timeout=5)
        assert err.errors, "the late Hold was not refused"
        pb2, db2 = p.allocate(4), d.allocate(4)  # the retry, under the same id: nothing computed
        d.wipe(db2)
        p.client.hold(tid, pb2, token=tid, streamed=True, expires_unix=time.time() + 60)
        d.client.recv(tid, db2, streamed_remote(p, tid), streamed=True, deadline_s=3)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert not got.done, "the retry's uncomputed blocks were read and reported Done"
        assert got.failed[0].code == ErrorCode.DEADLINE
