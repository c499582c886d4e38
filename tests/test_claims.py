"""One claim per request, whatever the local ranks (``kvxfer.sidecar.claim``, #35): a TP > 1
decode engine's ranks each send a ``Recv`` for the same request, and each used to send its own
``LeaseRenew``. Against a fake peer client (no sockets): how many claims go out, what each
rank's claim task answers, and when a rank must claim for itself."""

from __future__ import annotations

import asyncio
from typing import Any

from kvxfer.config import Config
from kvxfer.errors import ErrorCode
from kvxfer.observe import Observer
from kvxfer.protocol import LeaseRenew, LeaseState, Recv
from kvxfer.sidecar.claim import SHARE_SLACK_S, Claims
from kvxfer.sidecar.peer_book import PeerBook


class FakePeers:
    """Answers every renewal with ``answer`` once ``release`` is set."""

    def __init__(self, answer: str = "held") -> None:
        self.sent: list[LeaseRenew] = []
        self.answer = answer
        self.release = asyncio.Event()

    def send_renewal(self, host: str, port: int, req: LeaseRenew) -> Any:
        self.sent.append(req)
        return len(self.sent)

    async def renewal_answer(self, sent: Any, timeout_s: float) -> LeaseState:
        await self.release.wait()
        return LeaseState(seq=0, held=[self.answer])  # type: ignore[list-item]


class FakePeer:
    generation = ""

    def outdated_by(self, generation: str) -> bool:
        return False


def recv(req: str = "r1", rank: int = 0) -> Recv:
    return Recv(req_id=req, block_ids=[1], remote_engine_id="p", remote_host="127.0.0.1", remote_port=9000,
                remote_block_ids=[2], tp_rank=rank, remote_generation="g1", remote_token="t")


def claims(peers: FakePeers) -> Claims:
    return Claims(Config(), peers, PeerBook(), Observer(), "agent-d")  # type: ignore[arg-type]


def test_the_ranks_of_a_request_share_one_claim_and_each_gets_its_answer() -> None:
    async def run() -> tuple[int, list[Any], list[list[str]]]:
        peers = FakePeers()
        c = claims(peers)
        marks: list[list[str]] = [[] for _ in range(8)]
        tasks = [c.start(recv(rank=r), "p", 10.0, FakePeer(), marks[r].append) for r in range(8)]  # type: ignore[arg-type]
        other = c.start(recv("r2"), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        peers.release.set()
        got = await asyncio.gather(*tasks, other)
        return len(peers.sent), got, marks

    sent, got, marks = asyncio.run(run())
    assert sent == 2  # one for r1's 8 ranks, one for r2
    assert got == [None] * 9
    assert marks[0] == ["claim_sent", "claimed"]
    assert all(m == ["claim_shared", "claimed"] for m in marks[1:])


def test_a_rank_whose_read_ends_past_the_claims_cover_claims_for_itself() -> None:
    async def run() -> int:
        peers = FakePeers()
        c = claims(peers)
        first = c.start(recv(rank=0), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        c.start(recv(rank=1), "p", 10.0 + SHARE_SLACK_S / 2, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        late = c.start(recv(rank=2), "p", 10.0 + 2 * SHARE_SLACK_S, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        peers.release.set()
        await asyncio.gather(first, late)
        return len(peers.sent)

    assert asyncio.run(run()) == 2  # rank 1 shared rank 0's; rank 2's read outlasts its cover


def test_a_refused_claim_is_every_waiting_rank_s_answer_and_nobody_s_after() -> None:
    async def run() -> tuple[list[Any], int]:
        peers = FakePeers("gone")
        c = claims(peers)
        waiting = [c.start(recv(rank=r), "p", 10.0, FakePeer(), lambda _: None) for r in range(3)]  # type: ignore[arg-type]
        peers.release.set()
        got = await asyncio.gather(*waiting)
        peers.answer = "held"
        again = await c.start(recv(rank=3), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        assert again is None
        return got, len(peers.sent)

    got, sent = asyncio.run(run())
    assert [e.code for e in got] == [ErrorCode.EXPIRED] * 3
    assert sent == 2  # the rank after the refusal asked again


def test_a_retried_load_of_the_request_asks_again() -> None:
    """A retried load of the same request (a proxy resends the decode with the same
    kv_transfer_params) must ask the prefill again: the first read's final notice let it
    release the lease, and a held answer from before would vouch for blocks that may hold
    another request's KV (tests/test_state_pd.py's retried decode caught exactly that)."""
    async def run() -> int:
        peers = FakePeers()
        c = claims(peers)
        first = c.start(recv(rank=0), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        peers.release.set()
        assert await first is None
        await c.start(recv(rank=0), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        return len(peers.sent)

    assert asyncio.run(run()) == 2


def test_a_rank_that_comes_after_the_answer_asks_for_itself() -> None:
    """An answer vouches for the moment the prefill gave it: the lease may end right after
    (the prefill engine aborted the request, a drain) and no arithmetic on the cover sees it,
    so a read posted after the answer must not lean on it (a review's finding: a late rank
    joined a "held" answer and would have read released blocks)."""
    async def run() -> tuple[int, Any]:
        peers = FakePeers()
        c = claims(peers)
        first = c.start(recv(rank=0), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        peers.release.set()
        assert await first is None
        peers.answer = "gone"  # released in between
        late = await c.start(recv(rank=1), "p", 10.0, FakePeer(), lambda _: None)  # type: ignore[arg-type]
        return len(peers.sent), late

    sent, late = asyncio.run(run())
    assert sent == 2
    assert late is not None
    assert late.code == ErrorCode.EXPIRED


def test_a_lease_found_over_is_reported_before_the_read_unless_a_claim_went_beside_it() -> None:
    """``lease_expired_before_read`` (an event operators watch): from the claim beside a read;
    a claim after the landing that follows one says nothing new (the lease may have ended
    during the read); but one that is the read's only claim (none beside it: its lease word was
    to prove it, #38) reports it, as the claim beside it did (lost at first, found by a review)."""
    async def run(fresh: bool, first: bool) -> list[str]:
        peers, obs = FakePeers("gone"), Observer()
        c = Claims(Config(), peers, PeerBook(), obs, "agent-d")  # type: ignore[arg-type]
        with obs.subscribe(frozenset({"lease_expired_before_read"})) as q:
            peers.release.set()
            got = await c.start(recv(), "p", 10.0, FakePeer(), lambda _: None, fresh=fresh, first=first)  # type: ignore[arg-type]
            assert got is not None
            assert got.code == ErrorCode.EXPIRED
            return [q.get_nowait().kind for _ in range(q.qsize())]

    assert asyncio.run(run(fresh=False, first=False)) == ["lease_expired_before_read"]
    assert asyncio.run(run(fresh=True, first=False)) == []
    assert asyncio.run(run(fresh=True, first=True)) == ["lease_expired_before_read"]
