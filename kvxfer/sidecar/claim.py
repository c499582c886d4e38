"""The claim: before a read's ``Done`` goes out, the prefill sidecar confirms it still held
the blocks while they were read, and extends their lease over the read and its check.

Sent beside the read (over the peer's kept-open link, right after the read is posted, so
the round trip overlaps the copy) when no lease word can prove it; not at all for a read
that landed and was proved by its word inside the post, nor for one in flight that its word
will prove once it landed (``recv_state.start_claim``), whose claim, if the word does not,
goes after the landing (``Step.RECLAIM``); asked again, briefly, while
the prefill does not know the request yet (its ``Hold`` may still be on the way); judged
by ``receive.claim_verdict``. The answer is the claim task's result: None (held),
``PUBLISHED`` (held, and the lease's word is published: a word read after the landing must
show it, ``kvxfer.sidecar.lease_words``) or why the read must not be trusted.

One claim serves every local rank of a request (#35): each rank of a TP > 1 decode engine
sends its own ``Recv``, and each used to send its own ``LeaseRenew`` for the same request
(8 at TP 8, each a round trip and a lease extension at the prefill). A rank whose read ends
within what a claim of its request extends the lease over (``SHARE_SLACK_S`` inside its
margin) waits for that claim's answer instead, but only while the claim is unanswered: an
answer vouches for the moment the prefill gave it, and a read posted after it could follow
a release (the engine aborted, a drain) that no arithmetic sees; so a rank that comes later
asks for itself, as every rank did before (a review found the wider window). Ranks of one
local engine only, of the generation their request names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Event, Observer
from kvxfer.protocol import LeaseRenew, Recv
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.peer_link import RenewalSent
from kvxfer.sidecar.receive import claim_verdict

log = logging.getLogger("kvxfer.receiver")

# A rank may share a claim whose extension ends no more than this before its own would have
# (of the margin a claim adds beyond the read and a handshake timeout, 1 s): ranks of one
# request arrive milliseconds apart, each with its own deadline.
SHARE_SLACK_S = 0.5


@dataclass(frozen=True)
class Published:
    """A claim's answer: held, and the lease's word is published."""


PUBLISHED = Published()
ClaimAnswer = RequestError | Published | None
# (host, port, prefill engine, its request id, token, its generation, the local engine)
ClaimKey = tuple[str, int, str, str, str, str, str]


def _key(msg: Recv, engine: str) -> ClaimKey:
    return (msg.remote_host, msg.remote_port, engine, msg.remote_req_id or msg.req_id, msg.remote_token,
            msg.remote_generation, msg.engine_id)


@dataclass
class _Shared:
    covers_until: float  # monotonic: the end of the read it was sent for; one ending before
    # this plus SHARE_SLACK_S keeps all but the slack of the margin its own claim would give
    # (and its own started ReadNotice extends the lease over it as well)
    answer: asyncio.Future[ClaimAnswer]


def _mirror(src: asyncio.Future[ClaimAnswer], mark: Callable[[str], None]
            ) -> asyncio.Future[ClaimAnswer]:
    """A future of its own with ``src``'s outcome (a receive's claim task is its own)."""
    out: asyncio.Future[ClaimAnswer] = asyncio.get_running_loop().create_future()

    def copy(f: asyncio.Future[ClaimAnswer]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            if not isinstance(f.result(), RequestError):
                mark("claimed")
            out.set_result(f.result())

    src.add_done_callback(copy)
    return out


class Claims:
    def __init__(self, config: Config, peers: PeerClient, book: PeerBook, observer: Observer,
                 agent_name: str) -> None:
        self.config = config
        self.peers = peers
        self.book = book
        self.observer = observer
        self.agent_name = agent_name
        self._shared: dict[ClaimKey, _Shared] = {}  # unanswered claims, for other ranks to join

    def start(self, msg: Recv, engine: str, reading_s: float, peer: Peer, mark: Callable[[str], None],
              fresh: bool = False, first: bool = False) -> asyncio.Future[ClaimAnswer]:
        """Send the claim now (when a link to the peer is open) and keep at it in a task,
        or wait for the answer of a claim of the same request that covers this read (not when
        ``fresh``: one sent after a landing proves what an earlier one cannot). ``first``: a
        fresh one is the read's only claim (none went beside it): a lease found over is
        reported as one before a read, as the claim beside it did."""
        key = _key(msg, engine)
        now = time.monotonic()
        got = None if fresh else self._shared.get(key)
        if got is not None and not got.answer.done() and now + reading_s <= got.covers_until + SHARE_SLACK_S:
            mark("claim_shared")
            return _mirror(got.answer, mark)
        extend_s = reading_s + self.config.handshake_timeout_s + 1.0
        renew = LeaseRenew(seq=0, engine_id=engine, req_ids=[msg.remote_req_id or msg.req_id],
                           extend_s=extend_s, agent_name=self.agent_name, tokens=[msg.remote_token])
        sent = self.peers.send_renewal(msg.remote_host, msg.remote_port, renew)  # now, beside the read
        if sent is not None:
            mark("claim_sent")
        task = asyncio.ensure_future(self._run(msg, reading_s, renew, sent, peer, mark, fresh and not first))
        entry = self._shared[key] = _Shared(now + reading_s, task)
        task.add_done_callback(lambda _t: self._forget(key, entry))  # (answered: it serves nobody more)
        return task

    def _forget(self, key: ClaimKey, entry: _Shared) -> None:
        if self._shared.get(key) is entry:
            del self._shared[key]

    async def _run(self, msg: Recv, reading_s: float, renew: LeaseRenew, sent: RenewalSent | None, peer: Peer,
                   mark: Callable[[str], None], after: bool = False) -> ClaimAnswer:
        """Ask until an answer is final. An answer may take as long as the read it vouches
        for (a loaded prefill sidecar answers late, not wrongly), and no less than a
        handshake; a Hold still on its way is waited for one handshake timeout."""
        timeout = self.config.handshake_timeout_s
        now = time.monotonic()
        end, unknown_end = now + max(timeout, reading_s), now + timeout
        pause = 0.002
        while True:
            try:
                if sent is not None:
                    got = await self.peers.renewal_answer(sent, max(0.05, end - time.monotonic()))
                    sent = None
                else:
                    mark("claim_sent")
                    got = await self.peers.call_peer(msg.remote_host, msg.remote_port, renew,
                                                     max(0.05, end - time.monotonic()))
            except Exception as e:  # never leave a read waiting on a claim that raised
                if not isinstance(e, RequestError):
                    log.exception("claim of %s failed", msg.req_id)
                why = e.reason if isinstance(e, RequestError) else repr(e)
                stalled = isinstance(e, RequestError) and e.code == ErrorCode.PEER_STALLED
                return RequestError(ErrorCode.PEER_STALLED if stalled else ErrorCode.EXPIRED,
                                    f"the prefill did not confirm it still holds the blocks: {why}")
            moved = (None if msg.remote_generation or not peer.outdated_by(got.generation)
                     else (peer.generation, got.generation))
            verdict = claim_verdict(got.held[0] if got.held else "unknown", moved=moved,
                                    remaining_s=min(end, unknown_end) - time.monotonic(), pause_s=pause)
            if verdict.retry_in_s:
                await asyncio.sleep(verdict.retry_in_s)
                pause = min(pause * 2, 0.1)
                continue
            if verdict.stale_peer:
                self.book.mark_stale(peer)  # the next receive handshakes again
            if verdict.expired and not after:  # (one sent after a landing: it ended during the read)
                self.observer.emit(Event("lease_expired_before_read", request_id=msg.req_id,
                                         peer=f"{msg.remote_host}:{msg.remote_port}"))
            if verdict.refusal is None:
                mark("claimed")
                return PUBLISHED if got.published and got.published[0] else None
            return verdict.refusal

    async def generation_moved(self, msg: Recv, peer: Peer) -> bool:
        """Whether the prefill sidecar's generation is no longer the cached peer's: a renewal
        of no lease answers with it (one round trip on the kept-open link, no handshake, so a
        request that simply does not fit costs no handshake)."""
        try:
            probe = LeaseRenew(seq=0, engine_id=peer.resolve_engine(msg.remote_engine_id), req_ids=[],
                               agent_name=self.agent_name)
            got = await self.peers.call_peer(msg.remote_host, msg.remote_port, probe,
                                             self.config.handshake_timeout_s)
        except Exception as e:
            log.info("generation of %s:%d not asked: %s", msg.remote_host, msg.remote_port, e)
            return False
        return bool(got.generation) and got.generation != peer.generation
