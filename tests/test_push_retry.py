"""Push mode, a router's retry under the same transfer id while a read of the first hold is
in flight: the transfer id is the push hold's capability, and it used to key the lease word
and the claim too, so the retry's hold proved the first hold's read after the engine had
aborted it and reused its blocks (a review reproduced 2 of 4 delivered with another
request's bytes). Each push hold now has a read token of its own (``LayersAt.token``): the
retry's hold proves nothing of the first one's reads. Real sidecars, real NIXL reads."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvxfer.errors import ErrorCode
from kvxfer.protocol import LayersDone
from kvxfer.testing.engine import SyntheticEngine
from kvxfer.testing.procs import SidecarFactory
from tests.test_lease_words import BIG
from tests.test_push import LAYOUT, pair, streamed_remote
from tests.test_sidecar import wait_for


@pytest.mark.parametrize("words", [True, False], ids=["word", "no-word"])
def test_a_hold_again_under_the_transfer_id_proves_nothing_of_the_first_holds_read(
        sidecars: SidecarFactory, words: bool) -> None:
    """The prefill holds a computed request (push, streamed), the decode reads it (192 MiB,
    2 MiB at a time); mid-read the prefill engine aborts it (Released: it reuses the blocks)
    and the router's retry holds the same transfer id again on them, and other bytes are
    written into them. The first read is refused, or landed before the abort
    with the original bytes; never delivered with the next use's."""
    ds = sidecars.start(f"retry{int(words)}-d", "--chunk-mib", "2", "--max-inflight-chunks", "1",
                        "--verify-sample", "0")
    ps = sidecars.start(f"retry{int(words)}-p", *(() if words else ("--lease-word-slots", "0")))
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        refused = 0
        for attempt in range(4):
            tid = f"retry-{attempt}-{int(words)}-tid"
            pb, db = p.allocate(96), d.allocate(96)
            p.fill(tid, pb)
            p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
            p.client.send(LayersDone(req_ids=[tid], layers=BIG.num_layers))  # (computed: read at once)
            d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
            time.sleep(0.02 * (attempt + 1))
            p.client.release(tid)  # the engine aborted: once Released, it reuses the blocks
            wait_for(p.client, lambda a: bool(a.released))
            p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)  # the retry
            p.fill(f"other-{attempt}", pb)  # (computed into by the retry, or by another request)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            if got.failed:
                refused += 1
            else:
                assert d.verify(tid, db), "a read of the first hold delivered with the blocks' next use"
            p.client.release(tid)
            wait_for(p.client, lambda a: bool(a.released))
            d.free(db)
            p.free(pb)
        print(f"\n{refused} of 4 reads refused (the rest landed before their abort)")
        assert refused >= 1, "every read landed before its abort: nothing was tested"
        assert ds.proc.poll() is None
        assert ps.proc.poll() is None
    finally:
        d.close()
        p.close()


def test_a_decode_watching_a_refused_push_hold_fails_at_once(sidecars: SidecarFactory) -> None:
    """A push hold the prefill sidecar refuses (here: too late, its engine's deadline past):
    its decode, watching before or after, is answered "refused" and fails at once (it used to
    be told "unknown" until its deadline, 30 s here, and recompute then). Not told to a peer
    without the request's token; a retry held under the transfer id is read as any hold."""
    with pair(sidecars, "pushref") as (_ds, _ps, d, p):
        for early in (True, False):
            tid = f"refused-{early}"
            pb, db = p.allocate(4), d.allocate(4)
            if early:  # (the decode watches first: its watch waits for the Hold)
                d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
                time.sleep(0.2)
            t0 = time.monotonic()
            p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() - 5)
            assert wait_for(p.client, lambda a: bool(a.errors), timeout=5).errors
            if not early:
                d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=10)
            assert got.failed, got
            assert "hold was refused" in got.failed[0].reason, got.failed[0]
            assert time.monotonic() - t0 < 5, "the decode waited for its deadline"
            d.free(db)
        tid, db = "refused-False", d.allocate(4)  # another token: told nothing, its own deadline ends it
        other = dataclasses.replace(streamed_remote(p, tid), token="not-the-tid")
        d.client.recv(tid, db, other, streamed=True, deadline_s=2)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=10)
        assert got.failed[0].code == ErrorCode.DEADLINE, got.failed[0]
        pb, db = p.allocate(4), d.allocate(4)  # the router's retry under the same id: held, read
        p.fill(tid, pb)
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
        p.client.send(LayersDone(req_ids=[tid], layers=LAYOUT.num_layers))
        d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=10)
        assert got.done, got
        assert d.verify(tid, db)


def test_a_chunk_read_of_a_hold_made_again_is_not_used(sidecars: SidecarFactory) -> None:
    """A prompt held in chunks: a chunk of hold #1 is read (it has no proof of its own: the
    final read's proof covers it); the engine grows the hold, then aborts it and another
    request reuses its blocks; the router's retry holds the transfer id again on them. The
    decode's next answer comes from hold #2, whose read token proved the final read, and the
    chunk's bytes were delivered (a review: 3 of 3 wrong). Now an answer with another read
    token than the first ends the receive."""
    ds = sidecars.start("chunkretry-d", "--chunk-mib", "2", "--max-inflight-chunks", "1",
                        "--verify-sample", "0")
    ps = sidecars.start("chunkretry-p", "--lease-s", "30")
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    try:
        d.start()
        p.start()
        for attempt in range(3):
            tid, n, c = f"chunkretry-{attempt}", 100, 90
            pb, db = p.allocate(n), d.allocate(n)
            d.wipe(db)
            p.client.hold(tid, pb[:c], token=tid, streamed=True, partial=True, num_tokens=n * BIG.block_size,
                          expires_unix=time.time() + 60)
            d.client.recv(tid, db, streamed_remote(p, tid), streamed=True, deadline_s=30)
            p.fill(tid, pb[:c])
            p.client.send(LayersDone(req_ids=[tid], layers=0, blocks=c))  # (the first chunk computed)
            end = time.monotonic() + 10
            while not d.verify_layers(tid, db[:1], range(0, 1)) and time.monotonic() < end:
                time.sleep(0.001)  # (its read began)
            p.client.hold(tid, pb[:c + 1], token=tid, streamed=True, extends=True, partial=True,
                          num_tokens=n * BIG.block_size)  # the next chunk is scheduled ...
            p.client.release(tid)  # ... and the engine aborts the request
            wait_for(p.client, lambda a: bool(a.released))
            p.client.hold(tid, pb, token=tid, streamed=True, num_tokens=n * BIG.block_size,
                          expires_unix=time.time() + 60)  # the router's retry, on the same blocks
            p.kv.blocks()[:, :, np.asarray(pb[:c]), :] = 0xAB  # (another request reuses them first)
            p.fill(tid, pb)
            p.client.send(LayersDone(req_ids=[tid], layers=BIG.num_layers))
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert got.failed or d.verify(tid, db), "a chunk of the aborted hold was delivered"
            p.client.release(tid)
            wait_for(p.client, lambda a: bool(a.released))
            d.free(db)
            p.free(pb)
    finally:
        d.close()
        p.close()


def test_a_claim_with_the_transfer_id_is_not_told_the_word_is_published() -> None:
    """An older decode sidecar claims a push hold with the transfer id (it ignores
    ``LayersAt.token``) and tags its word with it: told "published", it read the word again,
    found none of its own and refused every push read (a review). Told so only with the
    read token the word is tagged with."""
    from kvxfer.config import Config
    from kvxfer.leases import Lease
    from kvxfer.observe import Observer
    from kvxfer.protocol import LeaseRenew
    from kvxfer.sidecar.holds import Holds
    from kvxfer.sidecar.lease_words import LeaseWords, lease_tag
    from tests.test_security import _Registry

    words = LeaseWords(64)
    h = Holds(Config(max_read_s=5.0, max_lease_s=60.0), _Registry(), Observer(), words=words)  # type: ignore[arg-type]
    now = time.monotonic()
    lease = Lease(req_id="tid", owner=b"w", block_ids=[1], expires=now + 10, created=now, engine="e",
                  token="tid", read_token="rt")
    h.table.add(lease)
    assert words.put(lease.key, lease_tag("e", "tid", lease.proof_token()), 1 << 60)
    for token, published in (("tid", False), ("rt", True)):
        state = h.renew(LeaseRenew(seq=1, engine_id="e", req_ids=["tid"], agent_name="a", tokens=[token]))
        assert (state.held, state.published) == (["held"], [published]), token


def test_a_words_deadline_is_renewed_by_its_own_lease_only() -> None:
    """A prompt held in chunks renews its engine's deadline with each chunk's Hold: the word
    kept the first one, and a long prefill's reads were refused past it (a review)."""
    from kvxfer.sidecar.lease_words import LeaseWords

    words = LeaseWords(64)
    assert words.put("k", 5, 100)
    assert words.put("k", 5, 200)
    assert words.word("k") == (5, 200)
    assert not words.put("k", 7, 300)  # (another tag under the key: not this lease's word)
    assert words.word("k") == (5, 200)


def test_a_failed_first_attempt_does_not_abort_the_retrys_hold(sidecars: SidecarFactory) -> None:
    """A streamed receive that ended before its prefill's Hold came told the prefill "will not
    read" with the transfer id as its token; the prefill kept that notice for the Hold and
    replayed it on the router's retry under the same id, whose lease ended at once (a review of
    the change that made refused receives tell the prefill: pull receives do, streamed ones
    leave it to stream_feed)."""
    with pair(sidecars, "rvkeep") as (_ds, _ps, d, p):
        tid = "rv-tid"
        db = d.allocate(4)
        # attempt 1: the prefill never held it (queued, then aborted by the router); the
        # decode gives up at its deadline
        d.client.recv("attempt-1", db, streamed_remote(p, tid), streamed=True, deadline_s=2)
        got = wait_for(d.client, lambda a: bool(a.failed), timeout=20)
        assert [f.code for f in got.failed] == [ErrorCode.DEADLINE], got.failed
        # the router's retry under the same transfer id: held, computed, and read by the decode
        pb = p.allocate(4)
        p.fill(tid, pb)
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
        early = p.client.wait_until(lambda a: bool(a.released), 1.5).released
        assert not early, f"the retry's hold ended before any decode read it: {early}"
        p.client.send(LayersDone(req_ids=[tid], layers=LAYOUT.num_layers))
        d.client.recv("attempt-2", db, streamed_remote(p, tid), streamed=True, deadline_s=20)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert not got.failed, got.failed
        assert got.done
