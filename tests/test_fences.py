"""Fences (``kvxfer.sidecar.nixl_fences``): after each NIXL notification a sidecar sends a
peer, a 16-byte READ from it, so that the next read from that peer lands inside its post.

In UCX peer mode the flush NIXL posts at the end of a transfer waits for the peer's progress
once a notification went out on the endpoint: without a fence, a small read after a
reader's ``ReadNotice`` returns PROC and lands a poll or two later. End to end (real
sidecars, real NIXL): warm one-block reads one after another, each followed by its final
notice, land inside their post, each notice followed by a fence. The state machine itself
against a stand-in agent (it is the only module under test there)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvxfer.client import RemoteBlocks
from kvxfer.sidecar import nixl_fences
from kvxfer.sidecar.nixl_fences import Fences
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

# 32 KiB per layer's K or V of a block, as the model
LAYOUT = make_layout(layers=4, num_blocks=64, heads=8, head_dim=128)


class StandIn:
    """What Fences calls of a NIXL agent; each transfer's states are scripted."""

    def __init__(self, states: list[str]) -> None:
        self.states = states  # what transfer() returns, then what each check returns, in turn
        self.posted: list[tuple[str, int]] = []  # (peer, remote address)
        self.released: list[int] = []
        self.refuse_release = False

    def register_memory(self, descs: Any, mem: str) -> str:
        return "reg"

    def deregister_memory(self, reg: Any) -> None:
        pass

    def get_xfer_descs(self, rows: Any, mem: str) -> Any:
        return rows

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> int:
        assert op == "READ"
        assert local[0][1] == remote[0][1] == nixl_fences.FENCE_BYTES
        self.posted.append((peer, int(remote[0][0])))
        return len(self.posted)

    def transfer(self, handle: int) -> str:
        return self.states.pop(0) if self.states else "DONE"

    def check_xfer_state(self, handle: int) -> str:
        return self.states.pop(0) if self.states else "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        if self.refuse_release:
            raise RuntimeError("still active")
        self.released.append(handle)


def test_a_fence_follows_a_notice_and_one_more_follows_a_notice_during_it() -> None:
    agent = StandIn(["PROC", "PROC", "DONE", "PROC", "DONE"])
    fences = Fences(agent, True)
    fences.target("p", 0x1000)
    fences.after_notice("unknown")  # (never loaded: nothing to read)
    assert agent.posted == []
    fences.after_notice("p")
    assert agent.posted == [("p", 0x1000)]
    assert len(fences) == 1
    fences.after_notice("p")  # its flush may predate this notice: one more, once this one settled
    assert len(agent.posted) == 1
    assert fences.poll() is True  # (PROC)
    assert fences.poll() is True  # DONE: released, and the second posted (PROC)
    assert agent.released == [1]
    assert len(agent.posted) == 2
    assert fences.poll() is False
    assert agent.released == [1, 2]
    assert fences.posted == 2


def test_none_without_lease_words_or_when_off_and_one_done_in_its_post_is_released_at_once() -> None:
    agent = StandIn(["DONE"])
    fences = Fences(agent, True)
    fences.target("p", 0x2000)
    fences.target("old", 0)  # (a peer without lease words)
    fences.after_notice("p")
    fences.after_notice("old")
    assert agent.posted == [("p", 0x2000)]
    assert agent.released == [1]
    assert len(fences) == 0
    off = Fences(StandIn([]), False)
    off.target("p", 0x2000)
    off.after_notice("p")
    assert off.posted == 0


def test_an_unload_lets_go_of_the_fence_in_flight_and_a_lagging_one_is_let_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = StandIn(["PROC"] * 10)
    fences = Fences(agent, True)
    fences.target("p", 0x1000)
    fences.after_notice("p")
    fences.forget("p")  # (nothing waits for it: a late landing writes only the fence's own bytes)
    assert agent.released == [1]
    assert len(fences) == 0
    fences.after_notice("p")  # (forgotten: no more fences to it)
    assert len(agent.posted) == 1
    fences.target("p", 0x1000)
    fences.after_notice("p")
    assert fences.poll() is True
    monkeypatch.setattr(nixl_fences, "GIVE_UP_S", 0.0)
    agent.refuse_release = True
    assert fences.poll() is False  # (let go: parked, released once NIXL allows)
    assert agent.released == [1]
    agent.refuse_release = False
    fences.poll()
    assert agent.released == [1, 2]


def _counts(sc: SidecarProc) -> tuple[float, float]:
    m = sc.scrape()
    return m["kvxfer_reads_landed_in_post"], m["kvxfer_notice_fences"]


@pytest.mark.parametrize("fences", [True, False])
def test_warm_small_reads_land_inside_their_post(fences: bool) -> None:
    """Each read is followed by its final ReadNotice to the prefill; the next read from that
    prefill lands inside its post when a fence followed the notice; with --no-notice-fences,
    measured here, none did (every read's flush waited for the prefill's next poll)."""
    n = 30
    with SidecarFactory() as f:
        ps = f.start("fence-p")
        flags = () if fences else ("--no-notice-fences",)
        ds = f.start("fence-d", *flags, metrics_port=free_port())
        p = SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
        d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
        try:
            reg = p.start()
            d.start()
            pb, db = p.allocate(1), d.allocate(1)
            where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb)
            landed0, fences0 = _counts(ds)
            for i in range(-2, n):  # (the first two: the handshake, a first use of the endpoint)
                if i == 0:
                    landed0, fences0 = _counts(ds)
                name = f"warm-{i}"
                p.fill(name, pb)
                p.client.hold(name, pb)
                time.sleep(0.003)  # (the prefill sidecar takes the hold first)
                d.client.recv(name, db, where)
                got = d.client.wait_until(lambda a: len(a.done) + len(a.failed) >= 1, 30)
                assert not got.failed, got.failed
                assert len(got.done) == 1
                assert d.verify(name, db), f"{name}: wrong bytes"
                p.client.wait_until(lambda a: len(a.released) >= 1, 10)
                time.sleep(0.02)
            landed, posted = _counts(ds)
        finally:
            p.close()
            d.close()
    landed -= landed0
    posted -= fences0
    if fences:
        assert landed >= n - 3, f"{landed:.0f} of {n} reads landed inside their post ({posted:.0f} fences)"
        assert posted >= n - 1, f"{posted:.0f} fences for {n} reads' notices"
    else:  # (measured here: 0 of 30 landed inside their post; not asserted, UCX's behaviour may change)
        assert posted == 0
