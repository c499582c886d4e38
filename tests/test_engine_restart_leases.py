"""A prefill engine that dies and is replaced (a new process registering the same engine id
and rank, with new memory) while its sidecar stays up: the dead engine's leases end with it.
They used to live on (a claim still answered "held", the lease word still published), and a
decode whose cached peer was of the old generation read the request a dead engine had held
from the very same block ids of the new engine's memory and delivered it as Done: the new
engine's KV as the old request's (found by a review; shown delivering P2's bytes without the
fix). A decode that had not cached the peer refuses the read `incompatible` either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from kvxfer.client import RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory

LAYOUT = make_layout(layers=2, num_blocks=32, heads=4, head_dim=32)


def _first_engine(endpoint: str, conn: Any) -> None:
    """P1: holds "warm" and "kept" (as the connector holds: a token each), then dies."""
    eng = SyntheticEngine(LAYOUT, endpoint, seed=1)
    reg = eng.start()
    gen = eng.client.ping().generation
    warm, kept = eng.allocate(2), eng.allocate(3)
    eng.fill("warm", warm)
    eng.client.hold("warm", warm, lease_s=60, token="t-warm")
    eng.fill("kept", kept)
    eng.client.hold("kept", kept, lease_s=60, token="t-kept")
    eng.client.ping(10)
    conn.send((reg.engine_id, reg.handshake_host, reg.handshake_port, warm, kept, gen))
    conn.recv()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("cached", [True, False], ids=["peer-cached", "peer-not-cached"])
def test_a_replaced_engines_old_leases_are_not_read(factory: SidecarFactory, cached: bool) -> None:
    ps = factory.start(f"rp{int(cached)}", "--engine-check-s", "0.2", "--handshake-timeout-s", "2")
    ds = factory.start(f"rd{int(cached)}", "--handshake-timeout-s", "2")
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    d.start()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_first_engine, args=(ps.endpoint, there))
    proc.start()
    p2 = None
    try:
        assert here.poll(60)
        engine_id, host, port, warm, kept, g1 = here.recv()
        if cached:  # the decode handshakes (caches the peer at the old generation) with a real read
            lw = d.allocate(2)
            old = RemoteBlocks(engine_id, host, port, warm, token="t-warm", generation=g1)
            d.client.recv("warm", lw, old)
            got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
            assert got.done, got.failed
            assert d.verify("warm", lw)
        here.send("go")
        proc.join(10)
        end = time.monotonic() + 20
        while f"engine process {proc.pid} exited" not in ps.log():
            assert time.monotonic() < end, "the prefill sidecar never noticed its engine die"
            time.sleep(0.05)
        p2 = SyntheticEngine(LAYOUT, ps.endpoint, seed=7)
        p2.start()
        p2.fill("p2-secret", kept)  # the new engine's KV in the very same block ids
        local = d.allocate(3)
        d.wipe(local)
        d.client.recv("kept", local, RemoteBlocks(engine_id, host, port, kept, token="t-kept", generation=g1))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
        assert not got.done, ("the dead engine's request was delivered, with the new engine's bytes: "
                              f"{d.verify('p2-secret', local)}")
        assert got.failed
        assert got.failed[0].code in ("expired", "incompatible"), got.failed
    finally:
        if proc.is_alive():
            proc.kill()
        d.close()
        if p2 is not None:
            p2.close()
