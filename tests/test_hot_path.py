"""The receive hot path through real sidecars: small reads are planned and posted by the
decode sidecar's event loop itself (``--inline-read-kib``), and larger ones while nothing
else waits for it (``--inline-alone-read-kib``), the others by its NIXL thread, both at
once without either corrupting the other's bytes."""

from __future__ import annotations

import time

from kvxfer.client import RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

LAYOUT = make_layout(layers=4, num_blocks=96, heads=4, head_dim=64)  # 128 KiB blocks
BLOCK = 4 * 2 * 16 * 4 * 64 * 2


def _posted_by_loop(sc: SidecarProc) -> float:
    return sc.scrape()["kvxfer_reads_posted_by_loop"]


def _read(p: SyntheticEngine, d: SyntheticEngine, reqs: dict[str, tuple[list[int], list[int]]],
          words: bool = False) -> None:
    """Hold, receive all of ``reqs`` at once (req -> (prefill blocks, decode blocks)), check
    every Done and every byte. ``words``: held with tokens, the generation named (as the
    connector does): lease words prove the reads, no claim keeps a receive open after its landing."""
    reg = p.registered
    assert reg is not None
    generation = p.client.ping().generation if words else ""
    for name, (pb, db) in reqs.items():
        p.fill(name, pb)
        d.wipe(db)
        p.client.hold(name, pb, token=f"t-{name}" if words else "",
                      expires_unix=time.time() + 60 if words else 0)
    for name, (pb, db) in reqs.items():
        d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                             generation=generation, token=f"t-{name}" if words else ""))
    got = d.client.wait_until(lambda a: len(a.done) + len(a.failed) >= len(reqs), 60)
    assert not got.failed, got.failed
    assert sorted(x.req_id for x in got.done) == sorted(reqs)
    for name, (_pb, db) in reqs.items():
        assert d.verify(name, db), f"{name}: wrong bytes"
    p.client.wait_until(lambda a: len(a.released) >= len(reqs), 20)


def _one_posted_by_loop(p: SyntheticEngine, d: SyntheticEngine, ds: SidecarProc, name: str,
                        pair: tuple[list[int], list[int]], words: bool = False) -> float:
    """Read ``pair`` until the loop posted one read (it may find the NIXL thread polling and
    hand the read over: one of a few is posted by the loop); exactly one was. The count before."""
    before = _posted_by_loop(ds)
    for i in range(5):
        _read(p, d, {f"{name}-{i}": pair}, words=words)
        if _posted_by_loop(ds) > before:
            break
    assert _posted_by_loop(ds) == before + 1
    return before


def test_small_reads_are_posted_by_the_loop_large_ones_by_the_nixl_thread() -> None:
    with SidecarFactory() as f:
        ps = f.start("hot-p")
        ds = f.start("hot-d", "--inline-read-kib", str(4 * BLOCK // 1024), "--inline-alone-read-kib", "0",
                     metrics_port=free_port())
        p = SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
        d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
        try:
            p.start()
            d.start()
            # the first read handshakes (from a task); it may or may not be posted inline
            _read(p, d, {"warm": (p.allocate(1), d.allocate(1))})
            # 512 KiB, the limit: posted by the loop, unless the NIXL thread happened to be
            # polling at that moment (then handed over): one of a few does
            before = _one_posted_by_loop(p, d, ds, "small", (p.allocate(4), d.allocate(4)))
            large = (p.allocate(5), d.allocate(5))  # 640 KiB: over the limit, never
            for i in range(3):
                _read(p, d, {f"large-{i}": large})
            assert _posted_by_loop(ds) == before + 1
            # both paths at once: large reads keep the NIXL thread inside NIXL while small
            # ones arrive (those find it busy, or commands queued ahead of them, and are
            # handed over, or post themselves). Each round opens with a small read, which
            # finds nothing queued: a large one first would send every read after it in the
            # burst to the NIXL thread (an inline read goes behind queued commands).
            blocks = [(p.allocate(n), d.allocate(n)) for n in (1, 12, 2, 12, 1, 3, 1, 2)]
            for r in range(3):
                _read(p, d, {f"mix-{r}-{i}": pair for i, pair in enumerate(blocks)})
            assert _posted_by_loop(ds) > before + 1
        finally:
            p.close()
            d.close()


def test_a_larger_read_alone_is_posted_by_the_loop_a_burst_of_them_by_the_nixl_thread() -> None:
    """``--inline-alone-read-kib``: a read over ``--inline-read-kib`` is posted by the loop too
    when nothing else waits for it (a 16 MiB read alone: ~0.3-0.6 ms sooner on 2 cores); the
    same reads sent at once are not (the loop would copy them one after another, its other
    work waiting: 8 at once, all posted by the loop, moved ~10 % less). Every byte checked."""
    with SidecarFactory() as f:
        ps = f.start("alone-p")
        ds = f.start("alone-d", "--inline-read-kib", str(BLOCK // 1024), "--inline-alone-read-kib",
                     str(8 * BLOCK // 1024), metrics_port=free_port())
        p = SyntheticEngine(LAYOUT, ps.endpoint, seed=5)
        d = SyntheticEngine(LAYOUT, ds.endpoint, seed=6)
        try:
            p.start()
            d.start()
            _read(p, d, {"warm": (p.allocate(1), d.allocate(1))})
            alone = (p.allocate(8), d.allocate(8))  # 1 MiB: over --inline-read-kib, within the other
            _one_posted_by_loop(p, d, ds, "alone", alone, words=True)
            burst = [(p.allocate(8), d.allocate(8)) for _ in range(8)]
            before = _posted_by_loop(ds)
            _read(p, d, {f"burst-{i}": pair for i, pair in enumerate(burst)}, words=True)
            assert _posted_by_loop(ds) - before <= 3, "a burst of larger reads was posted by the loop"
        finally:
            p.close()
            d.close()


def test_no_read_is_posted_by_the_loop_when_turned_off() -> None:
    with SidecarFactory() as f:
        ps = f.start("cold-p")
        ds = f.start("cold-d", "--inline-read-kib", "0", metrics_port=free_port())
        p = SyntheticEngine(LAYOUT, ps.endpoint, seed=3)
        d = SyntheticEngine(LAYOUT, ds.endpoint, seed=4)
        try:
            p.start()
            d.start()
            for i in range(3):
                _read(p, d, {f"off-{i}": (p.allocate(1), d.allocate(1))})
            assert _posted_by_loop(ds) == 0
        finally:
            p.close()
            d.close()
