"""The claim: before a read's ``Done`` goes out, the prefill sidecar confirms it still held
the blocks while they were read, and extends their lease over the read and its check.

Sent beside the read (over the peer's kept-open link, before the read is posted, so the
round trip overlaps the copy); asked again, briefly, while the prefill does not know the
request yet (its ``Hold`` may still be on the way); judged by ``receive.claim_verdict``.
The answer is the claim task's result: None (held), or why the read must not be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Event, Observer
from kvxfer.protocol import LeaseRenew, Recv
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient, RenewalSent
from kvxfer.sidecar.receive import claim_verdict

log = logging.getLogger("kvxfer.receiver")


class Claims:
    def __init__(self, config: Config, peers: PeerClient, book: PeerBook, observer: Observer,
                 agent_name: str) -> None:
        self.config = config
        self.peers = peers
        self.book = book
        self.observer = observer
        self.agent_name = agent_name

    def start(self, msg: Recv, engine: str, reading_s: float, peer: Peer,
              mark: Callable[[str], None]) -> asyncio.Future[RequestError | None]:
        """Send the claim now (when a link to the peer is open) and keep at it in a task."""
        renew = LeaseRenew(seq=0, engine_id=engine, req_ids=[msg.remote_req_id or msg.req_id],
                           extend_s=reading_s + self.config.handshake_timeout_s + 1.0,
                           agent_name=self.agent_name, tokens=[msg.remote_token])
        sent = self.peers.send_renewal(msg.remote_host, msg.remote_port, renew)  # now, before the read
        if sent is not None:
            mark("claim_sent")
        return asyncio.ensure_future(self._run(msg, reading_s, renew, sent, peer, mark))

    async def _run(self, msg: Recv, reading_s: float, renew: LeaseRenew, sent: RenewalSent | None, peer: Peer,
                   mark: Callable[[str], None]) -> RequestError | None:
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
                return RequestError(ErrorCode.EXPIRED,
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
            if verdict.expired:
                self.observer.emit(Event("lease_expired_before_read", request_id=msg.req_id,
                                         peer=f"{msg.remote_host}:{msg.remote_port}"))
            if verdict.refusal is None:
                mark("claimed")
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
