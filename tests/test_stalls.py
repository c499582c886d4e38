"""A stalled (frozen) prefill sidecar costs --peer-stall-s, not the deadline (#37).

Real sidecars, real NIXL: the prefill sidecar is SIGSTOPped (a frozen cgroup, a wedged
loop) while the decode reads from it. The decode sidecar finds it silent while it owes an
answer (a claim, or a probe while a read runs), stops and settles its reads at once, fails
them ``peer_stalled``, stays up, and handshakes the peer again once it answers. The
judgement itself (``kvxfer.sidecar.liveness``) is property-tested here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.client import Drained
from kvxfer.config import Config
from kvxfer.errors import ErrorCode
from kvxfer.observe import Observer
from kvxfer.sidecar.liveness import Liveness
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerChannel, PeerClient
from kvxfer.sidecar.stall_guard import StallGuard
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port
from tests.test_faults import remote_of
from tests.test_lease_words import handshaked
from tests.test_sidecar import wait_for

STALL_S = 1.0
BIG = make_layout(layers=32, num_blocks=200, heads=8, head_dim=128)  # 2 MiB per block


# ---------------------------------------------------------------------- the judgement


@given(st.lists(st.tuples(st.sampled_from(["ask", "answer", "heard", "drop"]),
                          st.floats(0, 3), st.integers(0, 5)), max_size=40))
def test_a_peer_that_spoke_within_stall_s_of_every_ask_is_never_stalled(events: list[tuple[str, float, int]]
                                                                        ) -> None:
    """Stalled exactly when something is owed and the peer was silent for stall_s since the
    later of its last word and the oldest ask still owed."""
    lv = Liveness(stall_s=2.0, heard_at=0.0)
    now, heard, owed = 0.0, 0.0, {}
    for kind, dt, seq in events:
        now += dt
        if kind == "ask":
            lv.asked(seq, now)
            owed[seq] = now
        elif kind == "answer":
            lv.answered(seq, now)
            owed.pop(seq, None)
            heard = now
        elif kind == "heard":
            lv.heard(now)
            heard = now
        else:
            lv.dropped(seq)
            owed.pop(seq, None)
        want = bool(owed) and now - max(heard, min(owed.values())) >= 2.0
        assert lv.stalled(now) == want
        assert not (lv.probe_due(now) and owed)  # a probe only when nothing is owed


def test_liveness_off_and_probes() -> None:
    off = Liveness(stall_s=0.0, heard_at=0.0)
    off.asked(1, 0.0)
    assert not off.stalled(100.0)
    assert not off.probe_due(100.0)
    lv = Liveness(stall_s=2.0, heard_at=0.0)
    assert not lv.probe_due(0.4)
    assert lv.probe_due(0.5)  # a quarter of stall_s of silence
    lv.asked(1, 0.5)
    assert not lv.probe_due(5.0)  # owed: the ask itself is the probe
    assert not lv.stalled(2.4)
    assert lv.stalled(2.5)
    lv.answered(1, 2.6)
    assert not lv.stalled(10.0)
    assert lv.probe_due(3.1)


# ---------------------------------------------------------------------- real sidecars


Pair = tuple[SyntheticEngine, SyntheticEngine, SidecarProc, SidecarProc]


def _pair(sidecars: SidecarFactory, name: str) -> Pair:
    ds = sidecars.start(f"{name}-d", "--peer-stall-s", str(STALL_S), "--chunk-mib", "2",
                        "--max-inflight-chunks", "1", metrics_port=free_port())
    ps = sidecars.start(f"{name}-p")
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    d.start()
    p.start()
    d.client.recv("warm", [], remote_of(p, []))  # handshake first
    wait_for(d.client, lambda a: bool(a.done))
    return d, p, ds, ps


def _nonzero(d: SyntheticEngine, blocks: list[int]) -> int:
    assert d.kv is not None
    return int(np.count_nonzero(d.kv.blocks()[:, :, np.asarray(blocks), :]))


def test_a_prefill_sidecar_frozen_before_the_claim_costs_stall_s(sidecars: SidecarFactory) -> None:
    """Its claim is never answered: the receive fails peer_stalled after ~--peer-stall-s (the
    deadline is 30 s), nothing lands in the blocks once the engine may reuse them, the decode
    sidecar stays up, and once the peer resumes it is handshaked again and read from."""
    d, p, ds, ps = _pair(sidecars, "stall-claim")
    try:
        pb, db = p.allocate(64), d.allocate(64)
        p.fill("frozen", pb)
        p.client.hold("frozen", pb)
        time.sleep(0.2)  # (the hold is in)
        os.kill(ps.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            d.client.recv("frozen", db, remote_of(p, pb), deadline_s=30)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            took = time.monotonic() - t0
            assert got.failed, got
            assert got.failed[0].code == ErrorCode.PEER_STALLED, got
            assert took < STALL_S + 2.0, took
            d.wipe(db)  # the engine reuses the blocks at once
            time.sleep(0.5)
            assert _nonzero(d, db) == 0, "bytes landed after the failure was reported"
            # a request that comes while it is still frozen fails within --peer-stall-s too
            t0 = time.monotonic()
            d.client.recv("frozen-2", db, remote_of(p, pb), deadline_s=30)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert got.failed, got
            assert got.failed[0].code == ErrorCode.HANDSHAKE_FAILED, got
            assert time.monotonic() - t0 < STALL_S + 1.0
        finally:
            os.kill(ps.proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert _nonzero(d, db) == 0, "bytes landed after the peer resumed"
        assert ds.proc.poll() is None, "the decode sidecar exited"
        assert ds.scrape().get("kvxfer_peer_stalls_total", 0) >= 1
        p.fill("after", pb[:8])
        p.client.hold("after", pb[:8])
        d.client.recv("after", db[:8], remote_of(p, pb[:8]))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert got.done, got
        assert d.verify("after", db[:8])
    finally:
        d.close()
        p.close()


def test_a_prefill_sidecar_frozen_mid_read_is_probed_and_costs_stall_s(sidecars: SidecarFactory) -> None:
    """Frozen after it answered the claim, while the read runs, with a notification to it
    pending (another request's read notice): in UCX peer mode the read then never ends, and
    nothing is owed. A probe finds the peer silent; the read is stopped and settled (it used
    to wait for its deadline, then the sidecar exited 3)."""
    d, p, ds, ps = _pair(sidecars, "stall-read")

    def ended(name: str) -> Callable[[Drained], bool]:
        return lambda a: any(m.req_id == name for m in [*a.done, *a.failed])

    try:
        for attempt in range(3):  # the stop must land while the read runs
            name = f"mid-{attempt}"
            pb, db = p.allocate(192), d.allocate(192)  # 384 MiB in 2 MiB chunks, one at a time
            p.fill(name, pb)
            p.client.hold(name, pb)
            d.client.recv(name, db, remote_of(p, pb), deadline_s=30)
            time.sleep(0.05)
            os.kill(ps.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                d.client.recv(f"nudge-{attempt}", [], remote_of(p, []))  # its read notice: pending
                got = wait_for(d.client, ended(name), timeout=30)
                took = time.monotonic() - t0
                failed = [m for m in got.failed if m.req_id == name]
                if failed:
                    d.wipe(db)
                    time.sleep(0.3)
            finally:
                os.kill(ps.proc.pid, signal.SIGCONT)
            if failed:
                assert failed[0].code == ErrorCode.PEER_STALLED, got
                assert took < STALL_S + 2.0, took
                time.sleep(0.5)
                assert _nonzero(d, db) == 0, "bytes landed after the failure"
                assert ds.proc.poll() is None
                return
            d.free(db)
            p.free(pb)
        raise AssertionError("the read always finished before the stop")
    finally:
        d.close()
        p.close()


# ---------------------------------------------------------------------- peers that went away


SMALL = make_layout(layers=4, num_blocks=32, heads=2, head_dim=32)


def _read_once(d: SyntheticEngine, ps: SidecarProc, name: str) -> SyntheticEngine:
    p = SyntheticEngine(SMALL, ps.endpoint, seed=1)
    p.start()
    pb, db = p.allocate(4), d.allocate(4)
    p.fill(name, pb)
    p.client.hold(name, pb)
    d.client.recv(name, db, remote_of(p, pb))
    got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
    assert got.done, got
    assert d.verify(name, db)
    d.free(db)
    return p


@pytest.mark.parametrize("blocks", [64, 16], ids=["nixl-thread", "alone-on-the-loop"])
def test_a_prefill_frozen_under_a_read_its_word_proves_costs_stall_s(sidecars: SidecarFactory,
                                                                     blocks: int) -> None:
    """A read its lease word proves sends no claim (#38), and the claim was what opened the
    decode's link to the prefill, which the stall guard judges and probes: with the prefill
    frozen under such a read (the first after a handshake: no link yet), nothing was ever owed,
    the read ran to its deadline, its chunks never settled and the decode sidecar exited
    (``ReadStuck``, exit code 3, found by a review). Now a peer reads run against is probed
    with no link open too: ``peer_stalled`` within --peer-stall-s, the sidecar up. 128 MiB go
    through the NIXL thread, 32 MiB are posted by the loop (alone)."""
    ds = sidecars.start(f"wstall{blocks}-d", "--peer-stall-s", str(STALL_S), "--settle-timeout-s", "3",
                        metrics_port=free_port())
    ps = sidecars.start(f"wstall{blocks}-p")
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    d.start()
    p.start()
    try:
        generation = handshaked(d, p)  # (no claim: no link)
        pb, db = p.allocate(blocks), d.allocate(blocks)
        p.fill("frozen", pb)
        p.client.hold("frozen", pb, token="tok-frozen", expires_unix=time.time() + 120)
        time.sleep(0.2)  # (the hold is in)
        os.kill(ps.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            d.client.recv("frozen", db, dataclasses.replace(remote_of(p, pb), token="tok-frozen",
                                                            generation=generation), deadline_s=5)
            got = d.client.wait_until(lambda a: bool(a.done or a.failed), 12)
            took = time.monotonic() - t0
            alive = ds.proc.poll() is None
        finally:
            os.kill(ps.proc.pid, signal.SIGCONT)
        assert alive, f"the decode sidecar exited ({ds.proc.poll()}) after {took:.1f}s"
        assert got.done or got.failed, f"no Done or Failed after {took:.1f}s (deadline 5 s)"
        if got.done:  # (proved by its word under the engine's own deadline: allowed)
            assert d.verify("frozen", db)
            return
        assert got.failed[0].code == ErrorCode.PEER_STALLED, got
        assert took < STALL_S + 2.0, took
    finally:
        d.close()
        p.close()


class _Nixl:
    """What PeerClient asks of the NIXL port when it drops a peer: which agents, when."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.changed = asyncio.Event()

    async def remove_peer(self, name: str, reason: str, stalled: bool = False) -> bool:
        self.removed.append(name)
        self.changed.set()
        return True

    async def until_removed(self, name: str) -> None:
        while name not in self.removed:
            self.changed.clear()
            await self.changed.wait()


def test_a_probe_pending_on_a_dropped_link_does_not_hold_up_the_next_one() -> None:
    """The guard probes a prefill that reads run against with no link open (one probe per
    endpoint at a time). A peer dropped while that probe waited (a read failed
    ``peer_disconnected``) used to leave it waiting on the closed link until its own timeout
    (2 x --peer-stall-s), and the endpoint's slot taken: the prefill, back and handshaked
    again, then frozen under a read its word proves, was found stalled after ~3.1 s instead
    of ~1.4 (found by a review). Now what waits on a dropped peer's link fails at once. A
    ROUTER that never answers stands in for the frozen prefill; no sidecars."""
    async def run() -> float:
        ctx, dial_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
        frozen = ctx.socket(zmq.ROUTER)
        port = frozen.bind_to_random_port("tcp://127.0.0.1")
        key, book, nixl, cfg = f"127.0.0.1:{port}", PeerBook(), _Nixl(), Config(peer_stall_s=STALL_S)
        client = PeerClient(config=cfg, channel=PeerChannel("d", "agent-d"), dial_ctx=dial_ctx, book=book,
                            registry=None, nixl=nixl, observer=Observer())  # type: ignore[arg-type]
        guard = StallGuard(cfg, client, book, lambda: {key})

        def peer(agent: str) -> Peer:
            return Peer(endpoint=key, engine_id="p", agent_name=agent, ranks={}, handshake_s=0.0,
                        connected_unix=0.0)

        book.put(peer("A"))
        await guard.check(time.monotonic())  # (no link: the probe opens one, the peer owes)
        await asyncio.sleep(0.1)
        assert key in client.link_keys()
        await client.drop_peer("A", "a read failed peer_disconnected")
        book.put(peer("B"))  # (handshaked again; a read runs against it)
        t0 = time.monotonic()
        loop = asyncio.ensure_future(guard.run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nixl.until_removed("B"), 8)
        took = time.monotonic() - t0
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        client.close()
        frozen.close(0)
        dial_ctx.term()
        ctx.term()
        return took

    took = asyncio.run(run())
    assert took < STALL_S + 0.6, f"found stalled after {took:.2f}s"


def test_what_a_decode_keeps_for_a_prefill_that_went_away_is_let_go(sidecars: SidecarFactory) -> None:
    """A prefill sidecar killed while idle, then replaced: on the same endpoint by a sidecar
    serving another engine (a replaced pod), it is read from at once (it failed unknown_peer
    before) and the old NIXL agent goes; on another endpoint, the idle probe finds the old
    one gone after --peer-idle-probe-s and lets go of its link, handshake and NIXL agent
    (they were kept until a read from it failed)."""
    ds = sidecars.start("gone-d", "--peer-stall-s", str(STALL_S), "--peer-idle-probe-s", "1",
                        metrics_port=free_port())
    d = SyntheticEngine(SMALL, ds.endpoint, seed=2)
    d.start()
    port = free_port()
    try:
        for i, where in enumerate(["first", "same endpoint", "another endpoint"]):
            ps = sidecars.start(f"gone-p{i}", "--handshake-port", str(port if i < 2 else free_port()))
            p = _read_once(d, ps, f"r{i}")
            m = ds.scrape()
            # the same endpoint: the old agent goes with the new handshake; another: both are kept
            assert m["kvxfer_nixl_remote_agents"] == (2 if i == 2 else 1), (where, m)
            ps.proc.kill()
            ps.proc.wait()
            p.close()
        t_end = time.monotonic() + 1 + STALL_S + 3  # (probe after 1 s idle, silent for STALL_S)
        while (m := ds.scrape())["kvxfer_nixl_remote_agents"] and time.monotonic() < t_end:
            time.sleep(0.1)
        assert m["kvxfer_nixl_remote_agents"] == 0, m
        assert m["kvxfer_peers"] == 0, m
        assert m.get("kvxfer_peer_stalls_total", 0) == 0, m  # (gone, not stalled)
        assert ds.proc.poll() is None
    finally:
        d.close()
