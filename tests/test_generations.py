"""Peers never stay stale. The prefill sidecar's registration generation (its agent, plus a
counter bumped whenever a registration is replaced or removed) travels in the handshake and
in kv_transfer_params; a decode whose cached peer has another generation handshakes again
before reading, and a failed read or a handshake that saw only some ranks is retried with a
fresh handshake. Without this the decode read the old memory of a re-registered engine, or
kept failing against a restarted sidecar or a partial handshake."""

from __future__ import annotations

import os
import signal

from kvxfer.client import RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port
from tests.conftest import pull
from tests.test_sidecar import wait_for

LAYOUT = make_layout(layers=2, num_blocks=32, heads=4, head_dim=32)


def read(p: SyntheticEngine, d: SyntheticEngine, req: str, n: int = 3) -> tuple[bool, str]:
    """Hold n fresh prefill blocks, read them into n decode blocks; (verified, failure)."""
    _, db, got = pull(p, d, req, n, timeout=30, tp_size=p.layout.tp_size,
                      generation=p.client.ping().generation)
    if got.failed:
        p.client.release(req)
        return False, f"{got.failed[0].code}: {got.failed[0].reason}"
    return d.verify(req, db), ""


def test_prefill_sidecar_restarted_on_the_same_endpoint(factory: SidecarFactory) -> None:
    port = free_port()
    ps = factory.start("gen-p", "--handshake-port", str(port), "--handshake-timeout-s", "2")
    ds = factory.start("gen-d", "--handshake-timeout-s", "2")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    try:
        p.start()
        d.start()
        assert read(p, d, "before") == (True, "")
        kept = p.allocate(3)
        p.fill("kept", kept)  # computed before the sidecar dies
        pools = sorted(p.pools.pools) if p.pools is not None else []
        os.kill(ps.proc.pid, signal.SIGKILL)
        ps.proc.wait()
        factory.start("gen-p", "--handshake-port", str(port), "--handshake-timeout-s", "2")
        p.start()  # the engine hands its pools back and re-registers (its connector would)
        assert pools
        assert sorted(p.pools.pools) == pools  # the same memory, not a new pool
        assert read(p, d, "after") == (True, "")  # the very next request, bytes verified
        # KV computed before the outage is served from the same pages, not refilled
        p.client.hold("kept", kept)
        reg = p.registered
        assert reg is not None
        db = d.allocate(3)
        d.client.recv("kept", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, kept,
                                               generation=p.client.ping().generation))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got.failed
        assert d.verify("kept", db)
    finally:
        p.close()
        d.close()


def test_prefill_engine_restarted_under_a_live_sidecar(factory: SidecarFactory) -> None:
    ps = factory.start("gen2-p", "--handshake-timeout-s", "2")
    ds = factory.start("gen2-d", "--handshake-timeout-s", "2")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    p2 = None
    try:
        p.start()
        d.start()
        assert read(p, d, "old-engine") == (True, "")
        # A new engine process takes over the rank with new memory (larger, so it cannot be
        # mapped where the old one was: the stale addresses point at nothing).
        p2 = SyntheticEngine(make_layout(layers=2, num_blocks=96, heads=4, head_dim=32), ps.endpoint, seed=7)
        p2.start()
        assert read(p2, d, "new-engine") == (True, "")
    finally:
        p.close()
        d.close()
        if p2 is not None:
            p2.close()


def test_a_handshake_that_saw_only_some_ranks_is_retried(factory: SidecarFactory) -> None:
    ps = factory.start("gen3-p", "--handshake-timeout-s", "2")
    ds = factory.start("gen3-d", "--handshake-timeout-s", "2")
    lay = [make_layout(layers=2, num_blocks=32, heads=4, head_dim=32, tp_rank=r, tp_size=2) for r in (0, 1)]
    p0, p1 = SyntheticEngine(lay[0], ps.endpoint, seed=1), SyntheticEngine(lay[1], ps.endpoint, seed=1)
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    try:
        p0.start()
        d.start()
        ok, why = read(p0, d, "half")  # rank 1 of the prefill is not registered yet
        assert not ok
        assert "not_registered" in why
        p1.start()
        blocks = p0.allocate(2)
        p0.fill("whole", blocks)
        p1.fill("whole", blocks)
        p0.client.hold("whole", blocks)
        reg = p0.registered
        assert reg is not None
        db = d.allocate(2)
        d.client.recv("whole", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, blocks,
                                                tp_size=2, generation=p0.client.ping().generation))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got.failed
        assert d.verify("whole", db)
    finally:
        p0.close()
        p1.close()
        d.close()
