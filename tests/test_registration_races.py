"""Registrations against live, dead and replaced engines, found by a review and reproduced on
real sidecars (each test fails without its fix):

- another process of the same user presenting a live rank's connection identity (identities
  are the client's choice) replaced that rank with its own memory: a decode then read the
  impostor's bytes as the engine's;
- a dead engine's orphaned ranks, freed by the periodic check from a list taken before an
  await, took the replacement engine's new registration with them (it was being registered
  on the NIXL thread): the new engine's holds were refused and reads failed, for good;
- a refused registration still recorded the requests it named as abandoned (for as long as
  it asked), so another engine's own holds of those ids were refused ``expired``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import msgspec

from kvxfer.auth import new_token
from kvxfer.client import RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port


def _lay(tp: int = 0, tp_size: int = 1, blocks: int = 32):  # type: ignore[no-untyped-def]
    return make_layout(layers=2, num_blocks=blocks, heads=2, head_dim=32, tp_rank=tp, tp_size=tp_size)


IMPOSTOR = r'''
import os, sys, time, zmq, msgspec
from kvxfer.pool import PoolClient
from kvxfer.memory import SharedKV
from kvxfer.protocol import encode
from kvxfer.testing.engine import make_layout
endpoint, ident = sys.argv[1], sys.argv[2].encode()
lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
kv = SharedKV.create(lay, PoolClient.for_engine_socket(endpoint))
kv.data[:] = 0xEE
msg = msgspec.structs.replace(kv.register_message(), engine_id="victim", pid=os.getpid())
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.IDENTITY, ident)
s.connect(endpoint)
s.send(encode(msg))
time.sleep(1.0)  # (the answer goes to whoever owns that identity: here, the victim's ring)
print("sent", flush=True)
'''


def test_a_live_ranks_identity_does_not_let_another_process_replace_it(factory: SidecarFactory) -> None:
    ps = factory.start("spoof-p", metrics_port=free_port())
    ds = factory.start("spoof-d")
    p = SyntheticEngine(_lay(), ps.endpoint, seed=1, engine_id="victim")
    d = SyntheticEngine(_lay(), ds.endpoint, seed=2)
    try:
        p.start()
        d.start()
        assert p.client.ring is not None  # (it registered over its ring: that identity is what is spoofed)
        got = subprocess.run([sys.executable, "-c", IMPOSTOR, ps.endpoint, p.client.ring.ident],
                             capture_output=True, text=True, timeout=60, check=False)
        assert got.stdout.strip() == "sent", got.stdout + got.stderr[-2000:]
        deadline = time.monotonic() + 10
        while "rank_taken" not in ps.log():
            assert time.monotonic() < deadline, ps.log()[-3000:]
            time.sleep(0.05)
        blocks, db = p.allocate(2), d.allocate(2)
        p.fill("req", blocks)
        token = new_token()
        p.client.hold("req", blocks, token=token, engine_id="victim")
        reg = p.registered
        assert reg is not None
        d.wipe(db)
        where = RemoteBlocks("victim", reg.handshake_host, reg.handshake_port, blocks, token=token)
        d.client.recv("req", db, where)
        done = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert done.done, done.failed
        assert d.verify("req", db)  # (the engine's bytes, not the impostor's 0xEE)
    finally:
        p.close()
        d.close()


def test_a_refused_registration_abandons_nothing(factory: SidecarFactory) -> None:
    ps = factory.start("abandon-p")
    v = SyntheticEngine(_lay(), ps.endpoint, engine_id="victim")
    v.start()
    try:
        script = r'''
import os, sys, msgspec
from kvxfer.client import SidecarClient
from kvxfer.protocol import PoolMemory
from kvxfer.memory import _dense_registration
from kvxfer.testing.engine import make_layout
lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
msg = msgspec.structs.replace(_dense_registration(lay, PoolMemory(pool="no-such-pool", size=1 << 30)),
                              engine_id="victim", abandoned=["victim-req"], abandoned_s=1e9, pid=os.getpid())
c = SidecarClient(sys.argv[1])
try:
    c.register(msg, 10)
    print("registered")
except Exception as e:
    print("refused", e)
'''
        out = subprocess.run([sys.executable, "-c", script, ps.endpoint], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.stdout.startswith("refused"), out.stdout + out.stderr[-2000:]
        v.client.hold("victim-req", [1, 2], token=new_token(), engine_id="victim")
        errors = v.client.wait_until(lambda a: bool(a.errors), 1.0).errors
        assert not errors, errors  # (held: the refused registration spoke for nobody)
    finally:
        v.close()


def _big(tp: int, blocks: int):  # type: ignore[no-untyped-def]
    return make_layout(layers=4, num_blocks=blocks, heads=8, head_dim=128, tp_rank=tp, tp_size=2)


def _first_engine(endpoint: str, conn) -> None:  # type: ignore[no-untyped-def]
    es = [SyntheticEngine(_big(i, 16), endpoint, seed=1, engine_id="e") for i in (0, 1)]
    for e in es:
        e.start()
    es[0].client.hold("kept", [1, 2], lease_s=60, token="t", engine_id="e")
    es[0].client.ping(10)
    conn.send("held")
    conn.recv()
    os.kill(os.getpid(), signal.SIGKILL)


def test_freeing_a_dead_engines_orphans_spares_its_replacement(factory: SidecarFactory) -> None:
    ps = factory.start("orphan-p", "--engine-check-s", "0.01", metrics_port=free_port())
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    first = ctx.Process(target=_first_engine, args=(ps.endpoint, there))
    first.start()
    new: list[SyntheticEngine] = []
    d: list[SyntheticEngine] = []
    try:
        assert here.poll(60)
        assert here.recv() == "held"
        # the replacement's memory is large (its registration takes a while on the NIXL thread)
        new = [SyntheticEngine(_big(i, 1024), ps.endpoint, seed=2, engine_id="e") for i in (0, 1)]
        for e in new:
            e.client.ping(10)
        here.send("die")
        first.join(10)
        deadline = time.monotonic() + 10
        while ps.log().count("stay readable") < 2:  # (both ranks orphaned: a lease held them)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for e in new:
            e.client.register_nowait(msgspec.structs.replace(e.kv.register_message(), engine_id="e"))
        for e in new:
            got = e.client.wait_until(lambda a: bool(a.registered or a.errors), 30)
            assert got.registered, got.errors
        time.sleep(0.5)  # (checks every 10 ms: one falls in the replacement's registration)
        assert ps.scrape()["kvxfer_registered_ranks"] == 2
        ds = factory.start("orphan-d")
        d = [SyntheticEngine(_big(i, 64), ds.endpoint, seed=3) for i in (0, 1)]
        for e in d:
            e.start()
        for e in new:
            e.fill("new", [3, 4])
        new[0].client.hold("new", [3, 4], lease_s=20, token="t2", engine_id="e")
        pong = new[0].client.ping(10)
        for i, e in enumerate(d):
            db = e.allocate(2)
            e.client.recv("new", db, RemoteBlocks("e", pong.handshake_host, pong.handshake_port, [3, 4],
                                                  tp_size=2, token="t2"), tp_rank=i)
            got = e.client.wait_until(lambda a: bool(a.done or a.failed), 20)
            assert got.done, got.failed
            assert e.verify("new", db)
    finally:
        if first.is_alive():
            first.kill()
        for e in new + d:
            e.close()


def test_a_replacements_leases_do_not_keep_a_dead_engines_ranks(factory: SidecarFactory) -> None:
    """An engine died holding a lease (both its TP ranks kept, orphaned, for that lease's
    reader). Its rank 0 comes back (its registration ends the old leases: their memory is
    gone) and the engine holds a new lease, in the new memory, before its rank 1 is back. The
    dead rank 1 goes at the next check: the new lease keeps nothing of the dead engine's alive
    (counted by engine id, it kept the dead rank's memory mapped until rank 1 came back, or
    for ever if it never did; found by review)."""
    ps = factory.start("orph2-p", "--engine-check-s", "1", metrics_port=free_port())
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    first = ctx.Process(target=_first_engine, args=(ps.endpoint, there))
    first.start()
    new: SyntheticEngine | None = None
    try:
        assert here.poll(60)
        assert here.recv() == "held"
        here.send("die")
        first.join(10)
        deadline = time.monotonic() + 10
        while ps.log().count("stay readable") < 2:  # (both ranks orphaned: a lease held them)
            assert time.monotonic() < deadline, ps.log()[-3000:]
            time.sleep(0.05)
        new = SyntheticEngine(_big(0, 16), ps.endpoint, seed=2, engine_id="e")
        new.start()
        new.client.hold("new", [3, 4], lease_s=60, token="t2", engine_id="e")
        new.client.ping(10)
        assert "leases on its old memory ended" in ps.log()
        deadline = time.monotonic() + 10  # (checks every second)
        while ps.scrape()["kvxfer_orphaned_ranks"] > 0:
            assert time.monotonic() < deadline, ps.log()[-3000:]
            time.sleep(0.1)
        got = ps.scrape()
        assert got["kvxfer_registered_ranks"] == 1, got
        assert got["kvxfer_held_leases"] == 1, got  # (the replacement's, still held)
    finally:
        if first.is_alive():
            first.kill()
        if new is not None:
            new.close()
