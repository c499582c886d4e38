"""Lease words (#38): a read's lease is proved by one 16-byte READ after the data landed,
not by waiting for the claim's round trip; and a read whose lease ended while it ran (the
prefill engine aborted, a drain) is refused, which the claim alone, answered before the
end, did not catch.

The words and the receive machine's rules are unit-tested; then real sidecars: reads proved
by their words (every byte verified), and a lease released mid-read refused (shown
failing with the word check removed: the read was delivered with another request's bytes).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.sidecar.lease_words import NO_DEADLINE, LeaseWords, deadline_ms, lease_tag, proves
from kvxfer.sidecar.nixl_types import ReadFinished
from kvxfer.sidecar.receive import Exit, Receive, Step
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port
from tests.test_faults import remote_of
from tests.test_sidecar import wait_for

LANDED = ReadFinished("r", "peer", True, 1, 0.01)


# ---------------------------------------------------------------------- the words


def test_a_tag_is_keyed_by_the_token_and_a_word_proves_only_its_own_lease() -> None:
    a, b = lease_tag("e", "req", "tok-a"), lease_tag("e", "req", "tok-b")
    assert a
    assert b
    assert a != b
    assert lease_tag("e", "req", "") == 0  # no token: no word
    now = 1_000_000.0
    assert proves((a, deadline_ms(now + 10)), a, now)
    assert not proves((b, deadline_ms(now + 10)), a, now)  # another lease
    assert not proves((0, 0), a, now)  # cleared
    assert not proves((a, deadline_ms(now + 1)), a, now)  # its engine frees the blocks too soon
    assert proves((a, NO_DEADLINE), a, now)
    assert not proves((a, NO_DEADLINE), 0, now)


@given(st.lists(st.tuples(st.sampled_from(["put", "clear"]), st.integers(0, 40)), max_size=80))
def test_a_word_is_published_while_its_lease_holds_and_never_shows_an_ended_one(ops: list[tuple[str, int]]
                                                                                 ) -> None:
    words = LeaseWords(8)  # (few slots: collisions happen)
    held: dict[int, int] = {}  # key -> tag, of leases whose word was published
    for op, key in ops:
        tag = lease_tag("e", f"req-{key}", f"tok-{key}")
        if op == "put":
            if key in held:
                continue
            if words.put(key, tag, 123):
                held[key] = tag
        else:
            words.clear(key)
            held.pop(key, None)
        for k, t in held.items():
            assert words.word(k) == (t, 123)
        slots = {int(words.mem[2 * s]) for s in range(words.slots)} - {0}
        assert slots == set(held.values())  # nothing else is ever visible


# ---------------------------------------------------------------------- the rules


def test_a_word_that_shows_the_lease_delivers_without_the_claims_answer() -> None:
    r = Receive("r")
    r.start(False, 10)
    assert r.landed(LANDED, proof=True) is Step.CHECK
    assert r.succeed() is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE
    assert r.claimed(None, True) is Step.WAIT  # (the late answer changes nothing)


def test_a_refusal_after_the_word_proved_the_read_changes_nothing_while_it_is_verified() -> None:
    """A read proved by its word and sampled for --verify-sample, whose claim (sent after the
    post) is refused meanwhile (the lease ended after the landing): the verdict still ends it
    Done (it used to trip an assertion and fail INTERNAL, found by review)."""
    r = Receive("r")
    r.start(False, 10)
    assert r.landed(LANDED, proof=True) is Step.CHECK
    r.verifying()
    assert r.claimed(RequestError(ErrorCode.EXPIRED, "gone")) is Step.WAIT
    assert r.verified(None) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE


@pytest.mark.parametrize("proof", [False, None], ids=["word-gone", "word-not-read"])
def test_a_published_word_not_shown_at_the_landing_is_read_again(proof: bool | None) -> None:
    """The claim says the lease's word is published, and the word read after the landing did
    not show it (False) or was not made (None: it lagged past 50 ms, no scratch slot left):
    the claim's "held" may predate the landing (a lease ended during the read: an engine
    abort, a drain), so the word is read again rather than the claim trusted (with None it
    was, found by a review); gone then too, the read is refused."""
    r = Receive("r")
    r.start(False, 10)
    assert r.claimed(None, published=True) is Step.WAIT  # answered while the read ran
    assert r.landed(LANDED, proof=proof) is Step.REPROVE
    assert r.reproved(False) is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.CLAIM_REFUSED
    assert r.outcome.error is not None
    assert r.outcome.error.code == ErrorCode.EXPIRED
    late = Receive("r")  # landed first, then the claim's answer; a Hold that came late shows then
    late.start(False, 10)
    assert late.landed(LANDED, proof=proof) is Step.WAIT
    assert late.claimed(None, published=True) is Step.REPROVE
    assert late.reproved(True) is Step.CHECK
    assert late.succeed() is Step.END


def test_a_word_that_cannot_be_read_again_leaves_it_to_a_claim_after_the_landing() -> None:
    """Only a word that cannot be read at all, at the landing or after, leaves the read to a
    claim, and one sent after the landing: the first claim's "held" may predate it (a lease the
    prefill ended during the read was delivered: found by a review)."""
    r = Receive("r")
    r.start(False, 10)
    assert r.landed(LANDED, proof=None) is Step.WAIT
    assert r.claimed(None, published=True) is Step.REPROVE
    assert r.reproved(None) is Step.RECLAIM
    assert r.reclaimed(None) is Step.CHECK
    assert r.succeed() is Step.END
    refused = Receive("r")
    refused.start(False, 10)
    refused.landed(LANDED, proof=None)
    refused.claimed(None, published=True)
    refused.reproved(None)
    assert refused.reclaimed(RequestError(ErrorCode.EXPIRED, "gone")) is Step.END
    assert refused.outcome is not None
    assert refused.outcome.exit is Exit.CLAIM_REFUSED


def test_without_a_word_a_claim_after_the_landing_decides() -> None:
    for proof in (None, False):  # not read (old peer, slot taken, read lagged); or not published
        r = Receive("r")
        r.start(False, 10)
        assert r.landed(LANDED, proof=proof) is Step.WAIT
        assert r.claimed(None, published=False) is Step.RECLAIM
        assert r.reclaimed(None) is Step.CHECK
    sent_after = Receive("r")  # a read that landed inside its post: its claim went out after it
    sent_after.start(False, 10)
    sent_after.landed(LANDED, proof=None)
    sent_after.claim_sent()
    assert sent_after.claimed(None) is Step.CHECK
    staged = Receive("r")  # (a staged read: copied under the lease, its slot guarded by trust_until)
    staged.start(False, 10)
    assert staged.claimed(None, copied=True) is Step.WAIT
    assert staged.landed(LANDED) is Step.CHECK
    r = Receive("r")
    r.start(False, 10)
    r.claimed(RequestError(ErrorCode.EXPIRED, "gone"))
    assert r.landed(LANDED, proof=True) is Step.END  # a refusal that came first still fails it
    assert r.outcome is not None
    assert r.outcome.exit is Exit.CLAIM_REFUSED


def test_a_read_in_flight_its_word_will_prove_needs_no_claim_beside_it() -> None:
    """#38: a read handed to the NIXL thread, whose peer keeps a lease word for it, sends no
    claim beside it (``claim_deferred``): its word, read once it landed, proves it; a word that
    does not (not published, not read) leaves it to a claim sent after the landing, whose
    "held" delivers it and whose refusal fails it. A late answer of no claim changes nothing."""
    r = Receive("r")
    r.start(False, 10)
    r.claim_deferred()
    assert r.landed(LANDED, proof=True) is Step.CHECK
    assert r.succeed() is Step.END
    assert r.outcome is not None
    assert r.outcome.exit is Exit.DONE
    for proof in (False, None):
        r = Receive("r")
        r.start(False, 10)
        r.claim_deferred()
        assert r.claimed(None, published=True) is Step.WAIT  # (no claim of its own was sent)
        assert r.landed(LANDED, proof=proof) is Step.RECLAIM
        assert r.reclaimed(None) is Step.CHECK
        assert r.succeed() is Step.END  # (the claim's "held" is what trusts it: asserted inside)
        refused = Receive("r")
        refused.start(False, 10)
        refused.claim_deferred()
        assert refused.landed(LANDED, proof=proof) is Step.RECLAIM
        assert refused.reclaimed(RequestError(ErrorCode.EXPIRED, "gone")) is Step.END
        assert refused.outcome is not None
        assert refused.outcome.exit is Exit.CLAIM_REFUSED
        assert refused.outcome.error is not None
        assert "its lease word did not show it" in refused.outcome.error.reason  # (not "no lease word")


# ---------------------------------------------------------------------- real sidecars

BIG = make_layout(layers=32, num_blocks=200, heads=8, head_dim=128)  # 2 MiB per block
SMALL = make_layout(layers=4, num_blocks=64, heads=2, head_dim=32)


def handshaked(d: SyntheticEngine, p: SyntheticEngine) -> str:
    """The decode's sidecar handshakes the prefill's (an empty read); the generation a request
    names, as the connector's kv_transfer_params do."""
    d.client.recv("warm", [], remote_of(p, []))
    wait_for(d.client, lambda a: bool(a.done))
    return p.client.ping().generation


def test_reads_are_proved_by_their_lease_words(sidecars: SidecarFactory) -> None:
    ds = sidecars.start("lw-d", metrics_port=free_port())
    ps = sidecars.start("lw-p")
    d, p = SyntheticEngine(SMALL, ds.endpoint, seed=2), SyntheticEngine(SMALL, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        for i in range(10):
            pb, db = p.allocate(2), d.allocate(2)
            p.fill(f"w{i}", pb)
            p.client.hold(f"w{i}", pb, token=f"tok-{i}", expires_unix=time.time() + 60)
            d.client.recv(f"w{i}", db, dataclasses.replace(remote_of(p, pb), token=f"tok-{i}",
                                                          generation=p.client.ping().generation))
            got = wait_for(d.client, lambda a: bool(a.done or a.failed))
            assert got.done, got
            assert d.verify(f"w{i}", db)
            d.free(db)
            wait_for(p.client, lambda a: bool(a.released))
            p.free(pb)
        assert ds.scrape().get('kvxfer_lease_word_proofs_total{proved="yes"}', 0) == 10
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("words", [True, False], ids=["word", "no-word"])
def test_a_read_whose_lease_ended_during_it_is_refused(sidecars: SidecarFactory, words: bool) -> None:
    """The prefill engine aborts the request while the decode reads it (its lease ends, its
    blocks are reused at once): the claim had answered "held" when the read began, so it
    used to be delivered, with the reused blocks' bytes in it. Its lease word, read after
    the landing, is gone: refused ``expired``. Without a word (``--cuda on``, a slot taken:
    here the prefill keeps none) a claim sent after the landing decides: gone, refused (before,
    the first claim's "held" delivered 2 of 4 with the next use's bytes: found by a review).
    A read that landed before the abort may be delivered, and then holds the original bytes."""
    ds = sidecars.start(f"lwe{int(words)}-d", "--chunk-mib", "2", "--max-inflight-chunks", "1",
                        "--verify-sample", "0", metrics_port=free_port())
    ps = sidecars.start(f"lwe{int(words)}-p", *(() if words else ("--lease-word-slots", "0")))
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        generation = handshaked(d, p)
        refused = 0
        for attempt in range(4):
            name, tok = f"abort-{attempt}", f"tok-{attempt}"
            pb, db = p.allocate(96), d.allocate(96)  # 192 MiB, 2 MiB at a time
            p.fill(name, pb)
            p.client.hold(name, pb, token=tok, expires_unix=time.time() + 60)
            d.client.recv(name, db, dataclasses.replace(remote_of(p, pb), token=tok, generation=generation),
                          deadline_s=30)
            time.sleep(0.02 * (attempt + 1))
            p.client.release(name)  # the engine aborted: once Released, it reuses the blocks
            wait_for(p.client, lambda a: bool(a.released))
            p.fill(f"other-{attempt}", pb)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            if got.failed:
                assert got.failed[0].code == ErrorCode.EXPIRED, got
                refused += 1
            else:
                assert d.verify(name, db), "a read delivered with bytes of the blocks' next use"
            d.free(db)
            p.free(pb)
        print(f"\n{refused} of 4 reads refused (the rest landed before their abort)")
        assert refused >= 1, "every read landed before its abort: nothing was tested"
        assert ds.proc.poll() is None
    finally:
        d.close()
        p.close()


def test_a_read_its_word_proves_sends_no_claim_one_it_does_not_is_claimed_after_it_landed(
        sidecars: SidecarFactory) -> None:
    """#38: 16 MiB reads posted by the NIXL thread (a claim beside one, sent from the loop while
    the thread planned it, cost ~0.3 ms). The first's word proves it: no claim is sent at all.
    The prefill keeps one word slot, taken by the first lease, so the second's word proves
    nothing: a claim sent after its landing delivers it (with that claim's "held" not taken
    as the trust, it failed ``internal``). Every byte checked."""
    ds = sidecars.start("lwd-d", "--inline-alone-read-kib", "0", "--verify-sample", "0",
                        metrics_port=free_port())
    ps = sidecars.start("lwd-p", "--lease-word-slots", "1")
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        generation = handshaked(d, p)
        blocks = {name: (p.allocate(8), d.allocate(8)) for name in ("first", "second")}
        for name, (pb, _db) in blocks.items():
            p.fill(name, pb)
            p.client.hold(name, pb, token=f"tok-{name}", expires_unix=time.time() + 60)
        traces = {}
        for name, (pb, db) in blocks.items():
            d.client.recv(name, db, dataclasses.replace(remote_of(p, pb), token=f"tok-{name}",
                                                        generation=generation), trace=True)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed))
            assert got.done, got
            assert d.verify(name, db), f"{name}: wrong bytes"
            traces[name] = [hop for hop, _t in got.done[0].trace or []]
        assert "claim_sent" not in traces["first"], traces["first"]
        second = traces["second"]
        assert "claim_sent" in second, second
        assert second.index("claim_sent") > second.index("landed"), second
        m = ds.scrape()
        assert m.get('kvxfer_lease_word_proofs_total{proved="yes"}') == 1, m
        assert m.get('kvxfer_lease_word_proofs_total{proved="no"}') == 1, m
    finally:
        d.close()
        p.close()


def test_a_word_read_given_up_on_frees_its_slot_once_it_settled() -> None:
    """A word read that lags (a slow link) is given up on, its slot kept until the read settled
    and its handle was let go, then used again: slots lost for good ran out (4,096 lags) and
    every later read waited for its claim (found by a review). A fake agent: this is the
    slot bookkeeping, not NIXL."""
    from kvxfer.sidecar.nixl_reads import ProofScratch

    class Agent:
        def __init__(self) -> None:
            self.state: dict[int, str] = {}
            self.refuse: set[int] = set()
            self.n = 0

        def register_memory(self, *a: object) -> str:
            return "reg"

        def get_xfer_descs(self, *a: object) -> None:
            return None

        def initialize_xfer(self, *a: object) -> int:
            self.n += 1
            self.state[self.n] = "PROC"
            return self.n

        def transfer(self, h: int) -> str:
            return self.state[h]

        def check_xfer_state(self, h: int) -> str:
            return self.state[h]

        def release_xfer_handle(self, h: int) -> None:
            if h in self.refuse or self.state[h] == "PROC":
                raise RuntimeError("still active")
            del self.state[h]

    agent = Agent()
    scratch = ProofScratch(agent, 2)
    slots = [scratch.take(), scratch.take()]
    handles = [scratch.post(s, 0x1000, "p") for s in slots]
    for h, s in zip(handles, slots, strict=True):
        scratch.settle(h, s)  # (both lag: given up on)
    assert scratch.take() == -1
    scratch.retry()
    assert scratch.take() == -1  # still in flight: their slots may still be written
    agent.state[handles[0]] = "DONE"
    agent.state[handles[1]] = "ERR"
    agent.refuse.add(handles[1])  # (settled, but its handle not let go yet)
    scratch.retry()
    assert scratch.take() == slots[0]
    assert scratch.take() == -1
    agent.refuse.clear()
    scratch.retry()
    assert scratch.take() == slots[1]
    assert agent.state == {}  # every handle released
    assert scratch.lost == 2


def test_a_read_landed_in_its_post_claims_on_its_own_never_on_an_earlier_ranks_claim() -> None:
    """Ranks of one request share a claim that is still unanswered. A rank whose read landed
    inside its post sends its only claim after the landing, so that claim proves the lease
    held then; mirroring another rank's, sent before that landing, would have proved nothing
    and been taken for proof (found by a review of the change that requires a claim after the
    landing)."""
    from unittest import mock

    from kvxfer.sidecar.recv_state import start_claim

    landed, waiting = Receive("r"), Receive("r")
    for r in (landed, waiting):
        r.start(False, 10)
    landed.landed(LANDED, proof=None)
    claims = mock.Mock()
    for machine, fresh in ((landed, True), (waiting, False)):
        state = mock.Mock(machine=machine)
        start_claim(claims, state, mock.Mock(), 5.0)
        assert claims.start.call_args.kwargs["fresh"] is fresh
    assert landed.claimed(None) is Step.CHECK  # (its own claim, sent after the landing)
