"""kvxfer.sidecar.receive: the receive state machine, its every exit, in memory (no sidecar,
no NIXL); the claim's verdicts; planning a read against a peer's ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import RankInfo, Recv
from kvxfer.sidecar.nixl_types import ReadFinished
from kvxfer.sidecar.receive import Exit, Phase, Receive, Step, claim_verdict, plan_read
from kvxfer.testing.engine import make_layout

LANDED = ReadFinished("k", "agent", True, 4096, 0.01, descriptors=8)
FAILED = ReadFinished("k", "agent", False, 0, 0.01, code=ErrorCode.DEADLINE, reason="late")
GONE = ReadFinished("k", "agent", False, 0, 0.01, code=ErrorCode.PEER_DISCONNECTED, reason="gone")
EXPIRED = RequestError(ErrorCode.EXPIRED, "lease over")


def reading() -> Receive:
    r = Receive("req")
    assert r.start(nothing_to_read=False, remaining_s=1.0) is Step.WAIT
    assert r.phase is Phase.READING
    assert r.read_in_flight
    return r


def test_nothing_to_read_ends_done_and_releases_the_prefill() -> None:
    r = Receive("req")
    assert r.start(nothing_to_read=True, remaining_s=1.0) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.EMPTY
    assert r.outcome.ok
    assert r.outcome.notice is True


def test_a_deadline_spent_handshaking_ends_before_the_read() -> None:
    r = Receive("req")
    assert r.start(nothing_to_read=False, remaining_s=0.0) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.NOT_STARTED
    assert r.outcome.error is not None
    assert r.outcome.error.code == ErrorCode.DEADLINE
    assert r.outcome.notice is None  # nothing was read: the prefill's lease runs out by itself


@pytest.mark.parametrize("phase", ["handshake", "reading"])
def test_a_read_that_could_not_start_ends_not_started(phase: str) -> None:
    r = Receive("req") if phase == "handshake" else reading()
    assert r.not_started(RequestError(ErrorCode.INCOMPATIBLE, "no")) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.NOT_STARTED
    assert not r.outcome.peer_failed


def test_landed_then_claimed_is_done() -> None:
    r = reading()
    assert r.landed(LANDED) is Step.WAIT
    assert r.phase is Phase.VERIFYING  # the claim's answer is awaited
    assert not r.read_in_flight
    assert r.claimed(None) is Step.RECLAIM  # (its "held" may predate the landing: asked again after it)
    assert r.reclaimed(None) is Step.CHECK
    assert r.succeed() is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE
    assert r.outcome.read is LANDED
    assert r.outcome.notice is True


def test_claimed_then_landed_is_done() -> None:
    r = reading()
    assert r.claimed(None) is Step.WAIT  # the read is still in flight
    assert r.phase is Phase.READING
    assert r.landed(LANDED) is Step.RECLAIM
    assert r.reclaimed(None) is Step.CHECK
    assert r.succeed() is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE


@pytest.mark.parametrize("claim_first", [True, False])
def test_a_refused_claim_fails_a_landed_read(claim_first: bool) -> None:
    r = reading()
    if claim_first:
        r.claimed(EXPIRED)
        step = r.landed(LANDED)
    else:
        r.landed(LANDED)
        step = r.claimed(EXPIRED)
    assert step is Step.END
    out = r.outcome
    assert out is not None
    assert out.exit is Exit.CLAIM_REFUSED
    assert out.error is not None
    assert out.error.code == ErrorCode.EXPIRED
    assert out.error.req_id == "req"
    assert out.notice is False
    assert out.peer_failed


def test_a_failed_read_ends_read_failed_whatever_the_claim() -> None:
    r = reading()
    r.claimed(None)
    assert r.landed(FAILED) is Step.END
    out = r.outcome
    assert out is not None
    assert out.exit is Exit.READ_FAILED
    assert out.error is not None
    assert out.error.code == ErrorCode.DEADLINE
    assert out.notice is False
    assert out.peer_failed
    assert not out.drop_peer


def test_a_disconnected_peer_is_dropped_not_notified() -> None:
    r = reading()
    assert r.landed(GONE) is Step.END
    assert r.outcome is not None
    assert r.outcome.drop_peer
    assert r.outcome.notice is None


def test_a_sampled_read_is_verified_before_it_is_reported() -> None:
    r = reading()
    r.landed(LANDED)
    assert r.claimed(None) is Step.RECLAIM
    assert r.reclaimed(None) is Step.CHECK
    r.verifying()
    assert r.phase is Phase.VERIFYING
    assert r.verified(None) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE


def test_a_digest_mismatch_ends_integrity() -> None:
    r = reading()
    r.landed(LANDED)
    r.claimed(None)
    r.verifying()
    assert r.verified(RequestError(ErrorCode.INTEGRITY, "differ", "req")) is Step.END
    out = r.outcome
    assert out is not None
    assert out.exit is Exit.INTEGRITY
    assert out.notice is False
    assert out.peer_failed


@pytest.mark.parametrize("phase", ["handshake", "landed"])
def test_a_cancel_without_a_read_in_flight_ends_here(phase: str) -> None:
    r = Receive("req")
    if phase == "landed":
        r = reading()
        r.landed(LANDED)  # verifying: waits for its claim
    assert not r.read_in_flight
    assert r.cancelled(RequestError(ErrorCode.CANCELLED, "operator")) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.CANCELLED
    assert r.outcome.notice is False  # the prefill is told it will not be read: its lease ends now


def test_a_cancel_of_a_read_in_flight_goes_to_the_port() -> None:
    r = reading()
    assert r.read_in_flight  # the shell asks the port; its failure comes back as landed(...)
    assert r.landed(FAILED) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.READ_FAILED


def test_nothing_changes_an_ended_receive() -> None:
    r = reading()
    r.landed(FAILED)
    out = r.outcome
    for step in (r.landed(LANDED), r.claimed(None), r.verified(None), r.not_started(EXPIRED),
                 r.cancelled(EXPIRED)):
        assert step is Step.WAIT
    assert r.outcome is out


EVENTS = st.lists(st.sampled_from(["landed", "failed", "claimed", "refused", "cancel", "not_started"]),
                  max_size=6)


@given(EVENTS, st.booleans())
def test_a_receive_ends_at_most_once_and_never_done_unclaimed(events: list[str], sample: bool) -> None:
    """Whatever order events come in: one outcome at most, and Done only after the read
    landed and the prefill confirmed its lease."""
    r = reading()
    landed = claimed = False
    ends = 0
    for ev in events:
        before = r.outcome
        if ev == "landed":
            step = r.landed(LANDED)
            landed = landed or before is None
        elif ev == "failed":
            step = r.landed(FAILED)
        elif ev in ("claimed", "refused"):
            step = r.claimed(None if ev == "claimed" else EXPIRED)
            claimed = claimed or (ev == "claimed" and before is None)
        elif ev == "cancel":
            step = Step.WAIT if r.read_in_flight else r.cancelled(EXPIRED)
        else:
            step = r.not_started(EXPIRED)
        if step is Step.RECLAIM:  # (a claim after the landing: the prefill still holds it)
            step = r.reclaimed(None)
        if step is Step.CHECK:
            if sample:
                r.verifying()
                step = r.verified(None)
            else:
                step = r.succeed()
        if step is Step.END:
            ends += 1
        assert (r.outcome is None) == (r.phase is not Phase.ENDED)
    assert ends <= 1
    if r.outcome is not None and r.outcome.exit is Exit.DONE:
        assert landed
        assert claimed


# ---------------------------------------------------------------------- claim verdicts


def test_claim_verdicts() -> None:
    assert claim_verdict("held", moved=None, remaining_s=1, pause_s=0.01).refusal is None
    moved = claim_verdict("held", moved=("a/1", "a/2"), remaining_s=1, pause_s=0.01)
    assert moved.refusal is not None
    assert moved.refusal.code == ErrorCode.INCOMPATIBLE
    assert moved.stale_peer
    gone = claim_verdict("gone", moved=None, remaining_s=1, pause_s=0.01)
    assert gone.refusal is not None
    assert gone.refusal.code == ErrorCode.EXPIRED
    assert gone.expired
    again = claim_verdict("unknown", moved=None, remaining_s=1, pause_s=0.01)
    assert again.refusal is None
    assert again.retry_in_s == 0.01
    late = claim_verdict("unknown", moved=None, remaining_s=0.005, pause_s=0.01)
    assert late.refusal is not None
    assert "never arrived" in late.refusal.reason


# ---------------------------------------------------------------------- planning


def recv(**kw: object) -> Recv:
    return Recv(**{"req_id": "r", "block_ids": [1, 2], "remote_engine_id": "p", "remote_host": "h",  # type: ignore[arg-type]
                   "remote_port": 1, "remote_block_ids": [3, 4], "remote_tp_size": 2, **kw})


def ranks(tp: int, present: list[int], num_blocks: int = 16) -> dict[tuple[int, int], RankInfo]:
    return {(0, r): RankInfo(layout=make_layout(layers=2, num_blocks=num_blocks, heads=4, head_dim=8,
                                                tp_rank=r, tp_size=tp), regions=[])
            for r in present}


def test_plan_read_between_tp_sizes() -> None:
    local = make_layout(layers=2, num_blocks=16, heads=4, head_dim=8, tp_rank=0, tp_size=1)
    plans, pairing = plan_read(recv(), local, ranks(2, [0, 1]), "p")
    assert sorted(p.remote_rank for p in plans) == [0, 1]
    assert pairing.pairs(2, 2) == [(0, 0, 0), (1, 1, 0)]


@pytest.mark.parametrize(("msg", "remote", "code"), [
    (recv(remote_tp_size=4), ranks(2, [0, 1]), ErrorCode.INCOMPATIBLE),
    (recv(), ranks(2, [0]), ErrorCode.NOT_REGISTERED),
    (recv(remote_block_ids=[3, 99]), ranks(2, [0, 1]), ErrorCode.BLOCK_OUT_OF_RANGE),
])
def test_plan_read_refuses(msg: Recv, remote: dict[tuple[int, int], RankInfo], code: str) -> None:
    local = make_layout(layers=2, num_blocks=16, heads=4, head_dim=8)
    with pytest.raises(RequestError) as e:
        plan_read(msg, local, remote, "p")
    assert e.value.code == code
