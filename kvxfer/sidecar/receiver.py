"""The decode side of a sidecar: receives, driven through their state machine
(``kvxfer.sidecar.receive``).

A ``Recv`` becomes one receive per (request, local rank): admitted (``admission``), the peer
handshaked (once per peer, shared), the read planned (``receive.plan_read``) and handed to
the NIXL port with its lease *claim* sent beside it, an optional integrity check
(``--verify-sample``), then exactly one ``Done`` or ``Failed`` to the engine and a
``ReadNotice`` to the prefill.

Direction: this shell calls the peer client and the NIXL port; neither calls back into it
except through the events it subscribed to (``on_read_finished``, ``on_read_refused``).
Every change of a receive goes through its ``Receive`` machine, and every end through
``_end``, which does what the machine's ``Outcome`` says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvxfer.abandoned import Abandoned
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import Cancel, Recv, Staged
from kvxfer.sidecar.claim import ClaimAnswer, Claims
from kvxfer.sidecar.lease_words import proves
from kvxfer.sidecar.lifecycle import Signal
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.ownership import Creds, authorize
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.plan import StagedRead
from kvxfer.sidecar.receive import Outcome, Step
from kvxfer.sidecar.recv_state import (
    RecvState,
    RejectedRecv,
    admitted,
    check_generation,
    claim_answer,
    count_end,
    count_refused,
    done_message,
    failed_message,
    may_be_stale,
    notify_prefill,
    plan_for,
    plan_with_peer,
    proof_again,
    proof_of,
    read_spec,
    recv_key,
    start_claim,
    tells_refusal,
    window_spec,
)
from kvxfer.sidecar.registry import RankKey, RankRegistry
from kvxfer.sidecar.staged_reads import Prepared, Staging
from kvxfer.sidecar.staged_windows import WindowFailed
from kvxfer.sidecar.staging import Books
from kvxfer.sidecar.stream_feed import StreamFeed
from kvxfer.sidecar.verify import Verifier
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger("kvxfer.receiver")

CANCEL_AHEAD_S = 5.0  # a Cancel refuses its request's Recvs that come after it this long


class Receiver:
    def __init__(self, *, config: Config, registry: RankRegistry, peers: PeerClient, book: PeerBook,
                 nixl: NixlPort, observer: Observer, send: Callable[[bytes, Any], None],
                 spawn: Callable[[Any], None], agent_name: str,
                 abandoned: Abandoned | None = None, books: Books | None = None,
                 waiting: Callable[[], bool] = lambda: False) -> None:
        self.config = config
        self.registry = registry
        self.peers = peers
        self.book = book
        self.nixl = nixl
        self.observer = observer
        self._send, self._spawn, self._waiting = send, spawn, waiting  # (waiting: EngineRings.waiting)
        self.changed = Signal()  # a receive started or ended
        self.recvs: dict[str, RecvState] = {}
        self.verifier = Verifier(config, registry, peers, book, nixl, observer)
        self.claims = Claims(config, peers, book, observer, agent_name)
        self.staging = Staging(config, peers, book, nixl, agent_name, books)
        self.feed = StreamFeed(config=config, registry=registry, peers=peers, observer=observer, nixl=nixl,
                               staging=self.staging)
        self.abandoned = abandoned if abandoned is not None else Abandoned()  # (kvxfer.abandoned)

    def reading_from(self) -> set[str]:
        """The peers (host:port) that reads in flight run against, or streamed receives follow."""
        return {st.peer for st in self.recvs.values() if st.machine.read_in_flight or st.msg.streamed}

    # ------------------------------------------------------------------ engine requests

    def on_recv(self, ident: bytes, msg: Recv, sender: Creds, draining: bool = False,
                received_ns: int = 0) -> None:
        """Raises RequestError (``UNAUTHORIZED``: ``sender`` does not speak for the engine)."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "receive", engine,
                  msg.req_id)
        key = recv_key(msg.req_id, msg.tp_rank, engine, msg.pp_rank)
        if key in self.recvs:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "receive already in flight", msg.req_id)
        try:
            gave_up = (engine, msg.req_id) in self.abandoned
            state = admitted(ident, msg, engine, self.registry, draining, gave_up,
                             self.config.transfer_timeout_s, received_ns)
        except RejectedRecv as e:  # (counted as any failed transfer: operators see refusals too)
            self._send(e.ident, failed_message(msg, e.error))
            count_refused(self.observer, msg, e.error)
            return
        self.recvs[key] = state
        msg = state.msg
        self.changed.emit()
        if msg.streamed:
            self._spawn(self._handshake_then_read(key, state))
            return
        # The hot path: a peer handshaked (of the request's generation): planned and posted now
        peer = self.peers.cached_peer(msg.remote_host, msg.remote_port, msg.remote_generation)
        if peer is not None:
            try:
                check_generation(msg, peer)
                plans, pairing = plan_for(self.registry, state, peer)
            except Exception as e:
                if not may_be_stale(e, msg):
                    self._not_started(key, e)
                    return  # (missing ranks, or a stale description: handshake again below)
            else:
                try:
                    self._start_read(key, state, peer, plans, pairing, msg.deadline_s)
                except Exception as e:  # a bug must fail this receive, never leave it waiting
                    self._not_started(key, e)
                return
        self._spawn(self._handshake_then_read(key, state))

    def on_cancel(self, msg: Cancel, sender: Creds) -> None:
        """The engine dropped a request whose load may still run: cancel its ranks' receives."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "cancel", engine,
                  msg.req_id)
        err = RequestError(ErrorCode.CANCELLED, "the engine dropped the request", msg.req_id)
        # Its Recvs still on the way are refused (a large one crosses ZMQ, a Cancel the ring;
        # a rank's may come after another's was cancelled); those here are cancelled now.
        self.abandoned.add(engine, [msg.req_id], CANCEL_AHEAD_S)
        for key, st in [(k, st) for k, st in self.recvs.items() if (st.msg.req_id, st.local.engine) ==
                        (msg.req_id, engine)]:
            st.stopping = True
            self._spawn(self._cancel(key, err, st))

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED, reason: str = "cancelled by "
                     "operator", rank: RankKey | None = None) -> int:
        """Fail receives now: every rank's of ``req_id`` ("": every request's), or one ``rank``'s
        (its engine died) when named; returns how many."""
        keys = [k for k, st in self.recvs.items() if (st.msg.req_id == req_id or not req_id)
                and rank in (None, st.local)]
        for key in keys:  # (each to its end even if the caller goes, a cancelled RPC: it had set
            await asyncio.shield(self._cancel(key, RequestError(code, reason, req_id)))  # ``stopping``,
        return len(keys)  # then nothing ended it: no Done or Failed ever; found by a review)

    async def _cancel(self, key: str, err: RequestError, which: RecvState | None = None) -> None:
        state = self.recvs.get(key)
        if state is None or (which is not None and state is not which):
            return
        state.stopping = True  # (before any await: a streamed receive posts no pre-read after this)
        if state.machine.read_in_flight and await self.nixl.cancel(key, err.code, err.reason):
            return  # the port reports the read failed once it settled (on_read_finished)
        await self.feed.settle(key, err)  # (a pre-read of a streamed receive: settled first,
        await self.staging.settle(key, err)  # a staged one's earlier window too)
        if self.recvs.get(key) is state:
            self._step(key, state, state.machine.cancelled(err))

    # ------------------------------------------------------------------ handshake and plan

    async def _handshake_then_read(self, key: str, state: RecvState) -> None:
        """A receive whose peer must be handshaked first (or again)."""
        msg = state.msg
        start = time.monotonic()
        try:
            peer = await asyncio.wait_for(
                self.peers.current_peer(msg.remote_host, msg.remote_port, msg.remote_generation),
                timeout=msg.deadline_s)
            state.peer_agent = peer.agent_name  # (a cancel from now on tells the prefill)
            ended = self.recvs.get(key) is not state
            if ended or state.stopping:  # cancelled or failed meanwhile
                if ended and state.stopping:  # (cancelled, and ended with no peer to tell)
                    notify_prefill(self.nixl, self.registry, state, False)
                return
            state.mark("handshaked")
            if msg.streamed:  # (push mode: layers read while the prefill computes them: stream_feed)
                followed = await self.feed.follow(key, state, peer,
                                                  lambda: self.recvs.get(key) is state and not state.stopping)
                if self.recvs.get(key) is state:
                    state.msg, state.pre_bytes = followed.msg, followed.pre_bytes
                    self._start_read(key, state, peer, followed.plans, followed.pairing,
                                     state.deadline - time.monotonic())
                return
            planned = await plan_with_peer(self.registry, self.peers, self.book, self.claims, state, peer,
                                           lambda: self.recvs.get(key) is state and not state.stopping)
            if planned is not None:
                self._start_read(key, state, *planned, msg.deadline_s - (time.monotonic() - start))
        except TimeoutError:
            self._not_started(key, RequestError(ErrorCode.HANDSHAKE_FAILED, f"no handshake within "
                                                f"{msg.deadline_s}s"), state)
        except Exception as e:
            self._not_started(key, e, state)

    # ------------------------------------------------------------------ the read and its claim

    def _start_read(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan],
                    pairing: BlockPairing, remaining: float) -> None:
        """Planned: claim the lease and start the read (no await: a ReadFinished event answers, or
        a ReadRefused), or stage it (``staged_reads``: the claim and the prefill's copy first)."""
        msg = state.msg
        state.peer_agent = peer.agent_name
        state.proof = proof_of(state, peer)
        state.mark("planned")
        step = state.machine.start(not msg.block_ids and not msg.state_block_ids, remaining)
        if step is Step.END:
            self._step(key, state, step)
            return
        entry = self.registry.get(state.local)
        engine = state.remote_engine
        prepared = (None if entry is None
                    else self.staging.prepare(key, msg, entry.info, peer, engine, plans, pairing, remaining))
        if prepared is not None:
            windows = self.staging.windows_for(key, prepared, window_spec(key, state, peer, plans, pairing))
            task = asyncio.ensure_future(self.staging.ask(msg, state.remote_engine, prepared, remaining, peer,
                                                          state.mark, windows))
            state.claim_task = task
            task.add_done_callback(lambda t: self._staged(key, state, peer, plans, pairing, prepared, t))
            return
        self._claim_and_post(key, state, peer, plans, pairing, remaining)

    def _claim_and_post(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan],
                        pairing: BlockPairing, remaining: float) -> None:
        """The direct read, then its claim (the prefill confirms it holds the blocks), unless its
        lease word proves it: it landed inside its post, or will once it lands (``start_claim``)."""
        if state.stopping:  # (cancelled meanwhile: its cancel found nothing posted and ends it; a
            return  # read now would land in freed blocks, a claim extend the prefill's lease)
        self._post(key, state, peer, plans, pairing, remaining)
        if self.recvs.get(key) is not state:
            return  # (it ended inside the post: landed and proved, or failed)
        state.claim_task = start_claim(self.claims, state, peer, remaining, not self.config.cuda_enabled)
        if state.claim_task is not None:
            state.claim_task.add_done_callback(lambda task: self._claimed(key, state, task))

    def _post(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan], pairing: BlockPairing,
              remaining: float, staged: StagedRead | None = None) -> None:
        try:  # (a small read, or a larger one alone, lands in this call: the port's choice)
            self.nixl.read(read_spec(key, state, peer, plans, pairing, remaining, staged,
                                     alone=len(self.recvs) == 1 and not self._waiting()))
        except Exception as e:
            self._not_started(key, e)

    def _staged(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan], pairing: BlockPairing,
                prepared: Prepared, task: asyncio.Future[tuple[Staged | None, float]]) -> None:
        """The prefill's answer: read its slot, or directly (no room there), or fail; not if cancelled."""
        if self.recvs.get(key) is not state or state.stopping:  # (its cancel found nothing posted)
            return
        try:
            staged = self.staging.read_after(key, prepared, task)
        except WindowFailed as e:  # (a window was read: the receive's read failed, the prefill is told)
            return self._step(key, state, state.machine.landed(e.event))
        except RequestError as e:  # (its StageRequest may have been answered: the prefill is told; a review)
            return self._step(key, state, state.machine.not_started(e, tell=True))
        remaining = state.deadline - time.monotonic()
        if staged is None:  # no room at the prefill: the direct read and its claim
            return self._claim_and_post(key, state, peer, plans, pairing, remaining)
        state.machine.claimed(None, copied=True)  # (the copy was taken under the lease, and extended it)
        self._post(key, state, peer, plans, pairing, remaining, staged)

    def _claimed(self, key: str, state: RecvState, task: asyncio.Future[ClaimAnswer]) -> None:
        if self.recvs.get(key) is state:  # (the claim's answer: its task ended)
            self._step(key, state, state.machine.claimed(*claim_answer(task)))

    # ------------------------------------------------------------------ NIXL events

    def on_read_refused(self, event: ReadRefused) -> None:
        """The NIXL thread could not start a read it was handed (nothing was posted)."""
        if not (self.feed.refused(event) or self.staging.refused(event)) and event.req_id in self.recvs:
            self._not_started(event.req_id, event.error)

    def on_read_finished(self, event: ReadFinished) -> None:
        if self.feed.landed(event) or self.staging.landed(event):
            return  # (a streamed receive's pre-read, a staged one's earlier window)
        state = self.recvs.get(event.req_id)
        if state is None:
            return  # cancelled meanwhile: already reported
        if state.trace is not None:
            state.trace += event.trace
            state.mark("loop")
        proof = None if not event.ok or event.proof is None else proves(event.proof, state.proof[0],
                                                                        time.time())
        if proof is not None:
            self.observer.lease_word(proof)
        self._step(event.req_id, state, state.machine.landed(event, proof))

    async def _then(self, key: str, state: RecvState, awaited: Any, step: Callable[[Any], Step]) -> None:
        """An await in a landed receive's end, then ``step`` with its result (a bug: it fails)."""
        try:
            got = await awaited
        except Exception as e:
            return self._failed_by_bug(key, state, e)
        if self.recvs.get(key) is state:
            self._step(key, state, step(got))

    # ------------------------------------------------------------------ steps and ends

    def _step(self, key: str, state: RecvState, step: Step) -> None:
        """Do what the machine's last transition asks."""
        try:
            if step in (Step.REPROVE, Step.RECLAIM):  # (after the landing: its word again, or a claim)
                got = proof_again(step is Step.REPROVE, self.nixl, self.observer, self.claims, self.book,
                                  state)
                self._spawn(self._then(key, state, *got))
                return
            if step is Step.CHECK:
                peer = self.book.by_agent(state.peer_agent)
                if peer is not None and self.verifier.sample(peer):
                    state.machine.verifying()
                    checked = self.verifier.verify(state.msg, state.local, state.remote_engine,
                                                   lambda: plan_for(self.registry, state, peer), peer)
                    self._spawn(self._then(key, state, checked, state.machine.verified))
                    return
                step = state.machine.succeed()
            if step is Step.END:
                assert state.machine.outcome is not None
                self._end(key, state, state.machine.outcome)
        except Exception as e:
            self._failed_by_bug(key, state, e)

    def _failed_by_bug(self, key: str, state: RecvState, e: Exception) -> None:
        """A bug must fail this receive, never leave it waiting forever (nobody sees a task's exception)."""
        log.error("finishing receive %s", state.msg.req_id, exc_info=e)
        if self.recvs.get(key) is state:
            self.recvs.pop(key)
            self.staging.release(key)
            self._send(state.owner, failed_message(state.msg, RequestError(ErrorCode.INTERNAL, repr(e))))
            self.changed.emit()

    def _not_started(self, key: str, err: BaseException, which: RecvState | None = None) -> None:
        """A receive that could not start: its RequestError, or a bug as TRANSFER_ERROR. ``which``:
        only that receive (a handshake task outlives a cancelled one: never fail a newer one)."""
        state = self.recvs.get(key)
        if state is None or (which is not None and state is not which):
            return
        if not isinstance(err, RequestError):
            log.error("receive %s failed", state.msg.req_id, exc_info=err)
            err = RequestError(ErrorCode.TRANSFER_ERROR, repr(err))
        self._step(key, state, state.machine.not_started(err, tell=tells_refusal(state)))

    def _end(self, key: str, state: RecvState, out: Outcome) -> None:
        """The one way a receive ends: the engine first, then counters, then the prefill."""
        del self.recvs[key]
        self.staging.release(key)
        if out.ok:
            state.mark("reply")
        err = out.error
        self._send(state.owner, done_message(state, out.read) if err is None else failed_message(
            state.msg, RequestError(err.code, err.reason, state.msg.req_id)))
        count_end(self.observer, self.book, state, out)
        self.changed.emit()
        if out.drop_peer:
            self._spawn(self.peers.drop_peer(state.peer_agent, out.error.reason if out.error else ""))
        elif out.notice is not None and state.peer_agent:  # (none before the handshake)
            notify_prefill(self.nixl, self.registry, state, out.notice)
