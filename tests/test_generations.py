"""Peers never stay stale. The prefill sidecar's registration generation (its agent, plus a
counter bumped whenever a registration is replaced or removed) travels in the handshake and
in kv_transfer_params; a decode whose cached peer has another generation handshakes again
before reading, and a failed read or a handshake that saw only some ranks is retried with a
fresh handshake. Without this the decode read the old memory of a re-registered engine, or
kept failing against a restarted sidecar or a partial handshake."""

from __future__ import annotations

import os
import signal

import pytest

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



@pytest.mark.parametrize("change", ["fewer_blocks", "other_heads"])
def test_a_receive_without_generation_never_reads_a_re_registered_engine_by_its_old_layout(
        factory: SidecarFactory, change: str) -> None:
    """kv_transfer_params built by hand may lack ``remote_generation``. The prefill engine
    re-registers with another layout (new memory, likely mapped where the old one was, so the
    cached addresses still point into live memory):
    - fewer blocks: the cached description still plans, at the old region offsets; the
      claim's answer names the prefill's generation, so that read fails instead of
      delivering bytes from the wrong offsets, and the next one handshakes again;
    - other heads (the decode engine too): the cached description no longer plans; the
      receive handshakes again before failing, and reads."""
    ps = factory.start(f"gen4-{change}-p", "--handshake-timeout-s", "2")
    ds = factory.start(f"gen4-{change}-d", "--handshake-timeout-s", "2")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    p2 = None
    try:
        p.start()
        d.start()
        _, db, got = pull(p, d, "old-layout", 3)
        assert got.done
        assert d.verify("old-layout", db)
        p.close()
        if change == "fewer_blocks":
            fewer = make_layout(layers=2, num_blocks=24, heads=4, head_dim=32)
            p2 = SyntheticEngine(fewer, ps.endpoint, seed=7)
            p2.start()
        else:
            new = make_layout(layers=2, num_blocks=64, heads=2, head_dim=32)
            p2 = SyntheticEngine(new, ps.endpoint, seed=7)
            p2.start()
            d.close()
            d = SyntheticEngine(new, ds.endpoint, seed=8)
            d.start()
        results = []
        for i in range(2):
            _, db, got = pull(p2, d, f"new-layout-{i}", 3)
            results.append("ok" if got.done and d.verify(f"new-layout-{i}", db) else
                           "wrong bytes" if got.done else got.failed[0].code)
            if got.failed:
                p2.client.release(f"new-layout-{i}")
        # fewer blocks: the stale read fails (its cached addresses point at nothing, or
        # the claim's answer names the new generation), never with wrong bytes
        assert results[0] != "wrong bytes"
        assert results[0] in (("peer_disconnected", "transfer_error", "incompatible")
                              if change == "fewer_blocks" else ("ok",)), results
        assert results[1] == "ok", results
    finally:
        d.close()
        if p2 is not None:
            p2.close()


def test_the_claim_fails_a_read_planned_from_an_older_generation(factory: SidecarFactory) -> None:
    """The claim's answer names the prefill sidecar's generation. Another engine on it
    registers again after the decode handshaked (a replaced registration is a new
    generation): a receive that names no generation was planned from the older description,
    so it fails ('incompatible', whatever it read), and the next one handshakes again and
    reads."""
    ps = factory.start("gen5-p", "--handshake-timeout-s", "2")
    ds = factory.start("gen5-d", "--handshake-timeout-s", "2")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    other = SyntheticEngine(LAYOUT, ps.endpoint, seed=3, engine_id="another-engine")
    try:
        p.start()
        other.start()
        d.start()
        _, db, got = pull(p, d, "before", 2)
        assert got.done
        assert d.verify("before", db)
        before = p.client.ping().generation
        other.start()
        assert p.client.ping().generation != before
        # named the generation its blocks were held under: planned from that very handshake
        # (this engine's memory did not change), so it reads
        _, db, got = pull(p, d, "named-old", 2, generation=before)
        assert got.done, got.failed
        assert d.verify("named-old", db)
        _, _db, got = pull(p, d, "planned-from-old", 2)
        assert got.failed, "a read planned from an older generation was delivered"
        assert got.failed[0].code == "incompatible"
        assert "re-registered" in got.failed[0].reason
        p.client.release("planned-from-old")
        _, db, got = pull(p, d, "after", 2)
        assert got.done, got.failed
        assert d.verify("after", db)
    finally:
        p.close()
        d.close()
        other.close()
