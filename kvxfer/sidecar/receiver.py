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
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxfer.abandoned import Abandoned
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import Done, Failed, ReadNotice, Recv, Staged, encode
from kvxfer.sidecar.admission import admit_recv, recv_bytes, recv_deadline_s
from kvxfer.sidecar.claim import PUBLISHED, ClaimAnswer, Claims
from kvxfer.sidecar.lease_words import WORD_BYTES, lease_tag, proves
from kvxfer.sidecar.lifecycle import Signal
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.ownership import Creds, authorize
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.plan import ReadSpec, StagedRead
from kvxfer.sidecar.receive import Outcome, Receive, Step, plan_read
from kvxfer.sidecar.registry import RankKey, RankRegistry
from kvxfer.sidecar.staged_reads import Prepared, Staging
from kvxfer.sidecar.verify import Verifier
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger("kvxfer.receiver")


@dataclass
class RecvState:
    owner: bytes  # where Done / Failed go
    msg: Recv
    nbytes: int  # bytes this rank will receive
    started: float
    deadline: float
    local: RankKey  # the registered rank whose memory receives
    machine: Receive
    peer_agent: str = ""
    remote_engine: str = ""  # the prefill engine it reads, once the plan named it
    planned_from: str = ""  # the peer generation the plan came from
    trace: list[tuple[str, int]] | None = None  # (hop, monotonic ns) when the Recv asked for it
    claim_task: asyncio.Future[None] | None = field(default=None, repr=False)
    proof: tuple[int, int] = (0, 0)  # (tag, address) of its lease word at the peer (lease_words)

    def mark(self, hop: str) -> None:
        if self.trace is not None:
            self.trace.append((hop, time.monotonic_ns()))

    @property
    def peer(self) -> str:
        return f"{self.msg.remote_host}:{self.msg.remote_port}"

    @property
    def state(self) -> str:
        return self.machine.phase.value


def new_state(owner: bytes, msg: Recv, local: Any, wall: float, timeout_s: float,
              received_ns: int) -> RecvState:
    """An admitted receive's state, its deadline never past the engine's own (``local``: the
    registry entry of the rank whose memory receives)."""
    now = time.monotonic()
    nbytes = recv_bytes(local.layout, local.info.block_bytes(attention_only=True), msg)
    msg = msgspec.structs.replace(msg, deadline_s=recv_deadline_s(msg, wall, timeout_s))
    state = RecvState(owner=owner, msg=msg, nbytes=nbytes, started=now, deadline=now + msg.deadline_s,
                      local=local.key, machine=Receive(msg.req_id))
    if msg.trace:
        state.trace = [("sidecar", received_ns or time.monotonic_ns())]
        state.mark("accepted")
    return state


def claim_answer(task: asyncio.Future[ClaimAnswer]) -> tuple[RequestError | None, bool]:
    """A finished claim: (why the read is not trusted, None if held; its lease word published)."""
    if task.cancelled() or task.exception() is not None:
        why = "cancelled" if task.cancelled() else f"failed: {task.exception()!r}"
        return RequestError(ErrorCode.EXPIRED, f"claim {why}"), False
    answer = task.result()
    return (answer if isinstance(answer, RequestError) else None), answer is PUBLISHED


def local_blocks(msg: Recv) -> list[int]:
    """Every local block a receive writes (its contents are invalid when it fails)."""
    return list(msg.block_ids) + msg.state_pairs[0]


def failed_message(msg: Recv, err: RequestError) -> Failed:
    log.warning("request %s failed: [%s] %s", msg.req_id, err.code, err.reason)
    return Failed(req_id=msg.req_id, block_ids=local_blocks(msg), code=err.code, reason=err.reason,
                  tp_rank=msg.tp_rank, pp_rank=msg.pp_rank)


def done_message(state: RecvState, read: ReadFinished | None) -> Done:
    return Done(req_id=state.msg.req_id, nbytes=read.nbytes if read else 0,
                seconds=read.seconds if read else 0.0, descriptors=read.descriptors if read else 0,
                trace=None if state.trace is None else sorted(state.trace, key=lambda h: h[1]))


def notify_prefill(nixl: NixlPort, registry: RankRegistry, state: RecvState, ok: bool) -> None:
    """The read notice for the prefill: every (pp, tp) rank of this engine reads once.
    Sent at once, with no task of its own (one per receive used to cost a task, a future
    and a turn of the loop)."""
    msg = state.msg
    entry = registry.get(state.local)
    readers = entry.layout.tp_size * entry.layout.pp_size if entry is not None else 0
    notice = ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=ok, readers=readers,
                        engine_id=state.remote_engine, pp_rank=msg.pp_rank, token=msg.remote_token)
    nixl.notify_soon(state.peer_agent, encode(notice))


def recv_key(req_id: str, tp_rank: int, engine: str = "", pp_rank: int = 0) -> str:
    """One receive per (request, local rank): each rank reads its own memory."""
    return f"{engine}/{pp_rank}/{tp_rank}:{req_id}"


def may_be_stale(err: BaseException, msg: Recv) -> bool:
    """A plan failed in a way a fresh handshake may cure: ranks missing from it, an engine it
    does not serve (another sidecar, serving other engines, took over the endpoint: a
    replaced pod on the same address), or (for a request that names no generation, which
    would have caught it) a layout that no longer matches because the prefill engine
    re-registered since."""
    return isinstance(err, RequestError) and (
        err.code in (ErrorCode.NOT_REGISTERED, ErrorCode.UNKNOWN_PEER)
        or (err.code == ErrorCode.INCOMPATIBLE and not msg.remote_generation))


def check_generation(msg: Recv, peer: Peer) -> None:
    if peer.outdated_by(msg.remote_generation):
        raise RequestError(ErrorCode.INCOMPATIBLE, f"the prefill sidecar re-registered since "
                           f"these blocks were held (generation {msg.remote_generation}, now "
                           f"{peer.generation}); not reading stale memory")


def plan_for(registry: RankRegistry, state: RecvState, peer: Peer) -> tuple[list[RankPlan], BlockPairing]:
    """Which remote ranks to read and how blocks pair up; names the remote engine."""
    engine = peer.resolve_engine(state.msg.remote_engine_id)
    state.remote_engine = engine
    state.planned_from = peer.generation
    entry = registry.get(state.local)
    if entry is None:
        raise RequestError(ErrorCode.NOT_REGISTERED, f"local rank {state.local} was unregistered")
    return plan_read(state.msg, entry.layout, peer.engine_ranks(engine), engine)


def proof_of(state: RecvState, peer: Peer) -> tuple[int, int]:
    """(tag, address of the peer's lease word) that proves this receive's lease (0, 0: none).
    Only for a request that names the generation its blocks were held under (the connector's
    always do): one that does not is checked against the generation the claim's answer
    names, so it waits for that answer."""
    msg = state.msg
    if not msg.remote_generation:
        return 0, 0
    tag = lease_tag(state.remote_engine, msg.remote_req_id or msg.req_id, msg.remote_token)
    addr, slots = peer.lease_words
    return (tag, addr + WORD_BYTES * (tag % slots)) if tag and slots else (0, 0)


def read_spec(key: str, state: RecvState, peer: Peer, plans: list[RankPlan], pairing: BlockPairing,
              remaining: float, staged: StagedRead | None) -> ReadSpec:
    """What the NIXL port is asked to read for a receive."""
    msg = state.msg
    # The prefill side must not let its lease run out under a read in progress: the thread
    # that posts the first chunk tells it right after (it must not delay the read).
    started = ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=True,
                         reading_s=remaining, engine_id=state.remote_engine, pp_rank=msg.pp_rank,
                         token=msg.remote_token)
    return ReadSpec(req_id=key, peer=peer.agent_name, local_rank=state.local,
                    local_blocks=list(msg.block_ids), remote_blocks=list(msg.remote_block_ids), plans=plans,
                    pairing=pairing, deadline_s=remaining,
                    started_notice=encode(started), remote_engine=state.remote_engine,
                    state_blocks=msg.state_pairs, trace=state.trace is not None, staged=staged,
                    proof_addr=0 if staged is not None else state.proof[1])


class Receiver:
    def __init__(self, *, config: Config, registry: RankRegistry, peers: PeerClient, book: PeerBook,
                 nixl: NixlPort, observer: Observer, send: Callable[[bytes, Any], None],
                 spawn: Callable[[Any], None], agent_name: str,
                 abandoned: Abandoned | None = None) -> None:
        self.config = config
        self.registry = registry
        self.peers = peers
        self.book = book
        self.nixl = nixl
        self.observer = observer
        self._send = send
        self._spawn = spawn
        self.changed = Signal()  # a receive started or ended
        self.agent_name = agent_name
        self.recvs: dict[str, RecvState] = {}
        self.verifier = Verifier(config, registry, peers, book, nixl, observer)
        self.claims = Claims(config, peers, book, observer, agent_name)
        self.staging = Staging(config, peers, book, nixl, agent_name)
        self.abandoned = abandoned if abandoned is not None else Abandoned()  # (kvxfer.abandoned)

    def __len__(self) -> int:
        return len(self.recvs)

    def reading_from(self) -> set[str]:
        """The peers (host:port) that reads in flight run against."""
        return {st.peer for st in self.recvs.values() if st.machine.read_in_flight}

    # ------------------------------------------------------------------ engine requests

    def on_recv(self, ident: bytes, msg: Recv, sender: Creds, draining: bool = False,
                received_ns: int = 0) -> None:
        """Raises RequestError (``UNAUTHORIZED``: ``sender``, the sending process, does not
        speak for the engine whose memory would receive)."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "receive", engine,
                  msg.req_id)
        key = recv_key(msg.req_id, msg.tp_rank, engine, msg.pp_rank)
        if key in self.recvs:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "receive already in flight", msg.req_id)
        local = self.registry.find(engine, msg.pp_rank, msg.tp_rank)
        if msg.reply_to_rank and local is not None:
            ident = local.owner
        wall = time.time()
        try:
            admit_recv(msg, engine, local.layout if local is not None else None, draining=draining,
                       abandoned=(engine, msg.req_id) in self.abandoned, now_unix=wall,
                       registered=self.registry.describe)
        except RequestError as e:
            self._send(ident, failed_message(msg, e))
            return
        assert local is not None
        state = new_state(ident, msg, local, wall, self.config.transfer_timeout_s, received_ns)
        self.recvs[key] = state
        msg = state.msg
        self.changed.emit()
        # The hot path: a peer already handshaked (and of the generation the request names)
        # is planned and posted now, in this call, with no task and no await in between.
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

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED,
                     reason: str = "cancelled by operator") -> int:
        """Fail every rank's receive of a request now (all with ""); returns how many."""
        keys = [k for k, st in self.recvs.items() if st.msg.req_id == req_id or not req_id]
        for key in keys:
            await self._cancel(key, RequestError(code, reason, req_id))
        return len(keys)

    async def fail_rank(self, key: RankKey, reason: str) -> None:
        """A local rank is gone (its engine died): fail its receives."""
        for rkey in [k for k, st in self.recvs.items() if st.local == key]:
            await self._cancel(rkey, RequestError(ErrorCode.NOT_REGISTERED, reason))

    async def _cancel(self, key: str, err: RequestError) -> None:
        state = self.recvs.get(key)
        if state is None:
            return
        if state.machine.read_in_flight and await self.nixl.cancel(key, err.code, err.reason):
            return  # the port reports the read failed once it settled (on_read_finished)
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
            if self.recvs.get(key) is not state:
                return  # cancelled or failed while the handshake ran
            state.mark("handshaked")
            check_generation(msg, peer)
            try:
                plans, pairing = plan_for(self.registry, state, peer)
            except RequestError as e:
                if not may_be_stale(e, msg):
                    raise
                if e.code == ErrorCode.INCOMPATIBLE and not await self.claims.generation_moved(msg, peer):
                    raise e from None  # nothing is stale: the request does not fit this peer
                self.book.mark_stale(peer)  # ranks missing, or a stale description: ask again once
                peer = await asyncio.wait_for(self.peers.get_peer(msg.remote_host, msg.remote_port),
                                              timeout=msg.deadline_s)
                if self.recvs.get(key) is not state:
                    return  # cancelled (and reported) while it handshaked again: never read
                check_generation(msg, peer)
                plans, pairing = plan_for(self.registry, state, peer)
            self._start_read(key, state, peer, plans, pairing, msg.deadline_s - (time.monotonic() - start))
        except TimeoutError:
            self._not_started(key, RequestError(ErrorCode.HANDSHAKE_FAILED, f"no handshake within "
                                                f"{msg.deadline_s}s"), state)
        except Exception as e:
            self._not_started(key, e, state)

    # ------------------------------------------------------------------ the read and its claim

    def _start_read(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan],
                    pairing: BlockPairing, remaining: float) -> None:
        """Planned: claim the lease and start the read (no await: a ReadFinished event
        answers, or a ReadRefused), or stage it (``staged_reads``: the claim and the
        prefill's copy first, then the read of its slot)."""
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
            task = asyncio.ensure_future(self.staging.ask(msg, state.remote_engine, prepared, remaining, peer,
                                                          state.mark))
            state.claim_task = task
            task.add_done_callback(lambda t: self._staged(key, state, peer, plans, pairing, prepared, t))
            return
        self._claim_and_post(key, state, peer, plans, pairing, remaining)

    def _claim_and_post(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan],
                        pairing: BlockPairing, remaining: float) -> None:
        """The direct read. Its claim: the prefill confirms it still holds the blocks and
        extends the lease over the whole read, in parallel with it; Done waits for the
        answer, and a lease that was already over fails the load (the blocks may hold
        another request's KV)."""
        state.claim_task = self.claims.start(state.msg, state.remote_engine, remaining, peer, state.mark)
        state.claim_task.add_done_callback(lambda task: self._claimed(key, state, task))
        self._post(key, state, peer, plans, pairing, remaining)

    def _post(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan], pairing: BlockPairing,
              remaining: float, staged: StagedRead | None = None) -> None:
        try:
            self.nixl.read(read_spec(key, state, peer, plans, pairing, remaining, staged))  # (a small one
            # lands in this call: the port's choice)
        except Exception as e:
            self._not_started(key, e)

    def _staged(self, key: str, state: RecvState, peer: Peer, plans: list[RankPlan], pairing: BlockPairing,
                prepared: Prepared, task: asyncio.Future[tuple[Staged | None, float]]) -> None:
        """The prefill's answer to a staged receive's request: read its slot, or (no room
        there) read directly, or fail (nothing was posted)."""
        if self.recvs.get(key) is not state:
            return
        try:
            staged = self.staging.read_after(key, prepared, task)
        except RequestError as e:
            self._not_started(key, e)
            return
        remaining = state.deadline - time.monotonic()
        if staged is None:  # no room at the prefill: the direct read and its claim
            self._claim_and_post(key, state, peer, plans, pairing, remaining)
            return
        state.machine.claimed(None)  # (the copy was taken under the lease, and extended it)
        self._post(key, state, peer, plans, pairing, remaining, staged)

    def _claimed(self, key: str, state: RecvState, task: asyncio.Future[ClaimAnswer]) -> None:
        """The claim's answer (its task ended)."""
        if self.recvs.get(key) is state:
            self._step(key, state, state.machine.claimed(*claim_answer(task)))

    # ------------------------------------------------------------------ NIXL events

    def on_read_refused(self, event: ReadRefused) -> None:
        """The NIXL thread could not start a read it was handed (nothing was posted)."""
        if event.req_id in self.recvs:
            self._not_started(event.req_id, event.error)

    def on_read_finished(self, event: ReadFinished) -> None:
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

    async def _reprove(self, key: str, state: RecvState) -> None:
        """The lease word again: the claim says it is published, the read after the landing
        did not show it (the Hold came late, or the lease ended during the read)."""
        word = await self.nixl.read_word(state.peer_agent, state.proof[1])
        self.observer.lease_word(shows := word is not None and proves(word, state.proof[0], time.time()))
        if self.recvs.get(key) is state:
            self._step(key, state, state.machine.reproved(shows))

    # ------------------------------------------------------------------ steps and ends

    def _step(self, key: str, state: RecvState, step: Step) -> None:
        """Do what the machine's last transition asks."""
        try:
            if step is Step.REPROVE:
                self._spawn(self._reprove(key, state))
                return
            if step is Step.CHECK:
                peer = self.book.by_agent(state.peer_agent)
                if peer is not None and self.verifier.sample(peer):
                    state.machine.verifying()
                    self._spawn(self._verify(key, state, peer))
                    return
                step = state.machine.succeed()
            if step is Step.END:
                assert state.machine.outcome is not None
                self._end(key, state, state.machine.outcome)
        except Exception as e:  # a bug must fail this receive, never leave it waiting forever
            log.exception("finishing receive %s", state.msg.req_id)
            if self.recvs.get(key) is state:
                self.recvs.pop(key)
                err = RequestError(ErrorCode.INTERNAL, repr(e), state.msg.req_id)
                self._send(state.owner, failed_message(state.msg, err))
                self.changed.emit()

    async def _verify(self, key: str, state: RecvState, peer: Peer) -> None:
        mismatch = await self.verifier.verify(state.msg, state.local, state.remote_engine,
                                              lambda: plan_for(self.registry, state, peer), peer)
        if self.recvs.get(key) is state:
            self._step(key, state, state.machine.verified(mismatch))

    def _not_started(self, key: str, err: BaseException, which: RecvState | None = None) -> None:
        """A receive that could not start: its RequestError, or a bug as TRANSFER_ERROR.
        ``which``: only that receive (a handshake task outlives a cancelled receive, and
        must not fail a newer one under the same key)."""
        state = self.recvs.get(key)
        if state is None or (which is not None and state is not which):
            return
        if not isinstance(err, RequestError):
            log.error("receive %s failed", state.msg.req_id, exc_info=err)
            err = RequestError(ErrorCode.TRANSFER_ERROR, repr(err))
        self._step(key, state, state.machine.not_started(err))

    def _end(self, key: str, state: RecvState, out: Outcome) -> None:
        """The one way a receive ends: the engine first, then counters, then the prefill."""
        del self.recvs[key]
        self.staging.release(key)
        msg = state.msg
        peer = self.book.by_agent(state.peer_agent) if state.peer_agent else None
        if out.ok:
            read = out.read
            state.mark("reply")
            self._send(state.owner, done_message(state, read))
            if read is not None:
                self.observer.transfer_done(msg.req_id, state.peer, msg.tp_rank, read.nbytes, read.seconds,
                                            read.descriptors)
                if peer is not None:
                    self.book.read_done(peer, read.nbytes)
        else:
            assert out.error is not None
            err = RequestError(out.error.code, out.error.reason, msg.req_id)
            self.observer.transfer_failed(msg.req_id, state.peer, msg.tp_rank, err.code, err.reason)
            if out.peer_failed and peer is not None:
                self.book.read_failed(peer)  # counted; handshake again before the next read
            self._send(state.owner, failed_message(msg, err))
        self.changed.emit()
        if out.drop_peer:
            self._spawn(self.peers.drop_peer(state.peer_agent, out.error.reason if out.error else ""))
        elif out.notice is not None:
            notify_prefill(self.nixl, self.registry, state, out.notice)
