"""A receive's state and the pure-ish helpers the receiver builds its messages with: the
state of one (request, local rank) receive, its Done / Failed / read notice, its plan, its
lease word and its ReadSpec (``kvxfer.sidecar.receiver`` drives them)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import Done, Failed, ReadNotice, Recv, encode
from kvxfer.sidecar.admission import admit_recv, recv_bytes, recv_deadline_s
from kvxfer.sidecar.claim import PUBLISHED, ClaimAnswer, Claims
from kvxfer.sidecar.lease_words import WORD_BYTES, lease_tag, proves
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.plan import ReadSpec, StagedRead
from kvxfer.sidecar.receive import Outcome, Receive, Step, plan_read
from kvxfer.sidecar.registry import RankKey, RankRegistry
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
    pre_bytes: int = 0  # push mode: bytes its pre-reads moved before the read the machine follows
    stopping: bool = False  # being cancelled: no new read may be posted for it

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
    return Done(req_id=state.msg.req_id, nbytes=(read.nbytes if read else 0) + state.pre_bytes,
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
                        engine_id=state.remote_engine, pp_rank=msg.pp_rank, token=msg.remote_token,
                        reader_engine=state.local.engine)
    nixl.notify_soon(state.peer_agent, encode(notice))


def tells_refusal(state: RecvState) -> bool:
    """Whether a receive that ends with nothing posted tells its prefill it will not read (its
    blocks free at once, not at its lease's end): a pull receive whose peer is known. Not a
    streamed one: its token is the transfer id, which a router's retry holds again (a notice
    kept for a Hold not there yet would end the retry's lease: a review); stream_feed tells
    what it refuses itself. Not one with a read in flight (a bug after the post)."""
    return bool(state.peer_agent) and not state.msg.streamed and not state.machine.read_in_flight


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
    """Which remote ranks to read and how blocks pair up; names the remote engine and agent (a
    plan it refuses is told to it: the receive will not read, its blocks free at once)."""
    engine = peer.resolve_engine(state.msg.remote_engine_id)
    state.remote_engine, state.peer_agent = engine, peer.agent_name
    state.planned_from = peer.generation
    entry = registry.get(state.local)
    if entry is None:
        raise RequestError(ErrorCode.NOT_REGISTERED, f"local rank {state.local} was unregistered")
    return plan_read(state.msg, entry.layout, peer.engine_ranks(engine), engine)


async def plan_with_peer(registry: RankRegistry, peers: PeerClient, book: PeerBook, claims: Claims,
                         state: RecvState, peer: Peer, alive: Callable[[], bool]
                         ) -> tuple[Peer, list[RankPlan], BlockPairing] | None:
    """A pull receive planned against its handshaked peer. A plan that fails in a way a fresh
    handshake may cure (``may_be_stale``; an ``incompatible`` one only when the prefill's
    generation moved) marks the peer stale, handshakes once more and plans again. None: the
    receive ended meanwhile (``alive`` false)."""
    msg = state.msg
    check_generation(msg, peer)
    try:
        return (peer, *plan_for(registry, state, peer))
    except RequestError as e:
        if not may_be_stale(e, msg):
            raise
        if e.code == ErrorCode.INCOMPATIBLE and not await claims.generation_moved(msg, peer):
            raise e from None  # nothing is stale: the request does not fit this peer
    book.mark_stale(peer)  # ranks missing, or a stale description: ask again once
    left = max(0.0, state.deadline - time.monotonic())  # (the time left to it, not all of it again)
    peer = await asyncio.wait_for(peers.get_peer(msg.remote_host, msg.remote_port), timeout=left)
    if not alive():
        return None  # cancelled (and reported) while it handshaked again: never read
    check_generation(msg, peer)
    return (peer, *plan_for(registry, state, peer))


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
              remaining: float, staged: StagedRead | None, alone: bool = False) -> ReadSpec:
    """What the NIXL port is asked to read for a receive (``alone``: nothing else waits for the
    loop, ``ReadSpec.alone``)."""
    msg = state.msg
    # The prefill side must not let its lease run out under a read in progress: the thread
    # that posts the first chunk tells it right after (it must not delay the read).
    started = ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=True,
                         reading_s=remaining, engine_id=state.remote_engine, pp_rank=msg.pp_rank,
                         token=msg.remote_token, reader_engine=state.local.engine)
    return ReadSpec(req_id=key, peer=peer.agent_name, local_rank=state.local,
                    local_blocks=list(msg.block_ids), remote_blocks=list(msg.remote_block_ids), plans=plans,
                    pairing=pairing, deadline=state.deadline,
                    started_notice=encode(started), remote_engine=state.remote_engine,
                    state_blocks=msg.state_pairs, trace=state.trace is not None, staged=staged,
                    proof_addr=0 if staged is not None else state.proof[1], alone=alone)




def window_spec(key: str, state: RecvState, peer: Peer, plans: list[RankPlan],
                pairing: BlockPairing) -> Callable[[StagedRead, str], ReadSpec]:
    """What the NIXL port is asked to read for one earlier window of a staged receive
    (``staged_windows.Windows``): the receive's read of that slot, under its own id."""
    return lambda st, rid: dataclasses.replace(
        read_spec(key, state, peer, plans, pairing, state.deadline - time.monotonic(), st), req_id=rid)


class RejectedRecv(Exception):
    """A Recv refused at admission: its ``Failed`` goes to ``ident``."""

    def __init__(self, ident: bytes, error: RequestError) -> None:
        super().__init__(error.reason)
        self.ident = ident
        self.error = error


def admitted(ident: bytes, msg: Recv, engine: str, registry: RankRegistry, draining: bool, abandoned: bool,
             timeout_s: float, received_ns: int) -> RecvState:
    """A Recv's state once admitted (``admission``); RejectedRecv says why not and to whom."""
    local = registry.find(engine, msg.pp_rank, msg.tp_rank)
    if msg.reply_to_rank and local is not None:
        ident = local.owner
    wall = time.time()
    try:
        admit_recv(msg, engine, local.layout if local is not None else None, draining=draining,
                   abandoned=abandoned, now_unix=wall, registered=registry.describe)
    except RequestError as e:
        raise RejectedRecv(ident, e) from None
    assert local is not None
    return new_state(ident, msg, local, wall, timeout_s, received_ns)


def count_refused(observer: Observer, msg: Recv, err: RequestError) -> None:
    """A receive refused at admission (draining, a block out of range...), counted as failed."""
    observer.transfer_failed(msg.req_id, f"{msg.remote_host}:{msg.remote_port}", msg.tp_rank, err.code,
                             err.reason)


def count_end(observer: Observer, book: PeerBook, state: RecvState, out: Outcome) -> None:
    """A receive's end, counted: the transfer, and its peer's reads or failures."""
    msg = state.msg
    peer = book.by_agent(state.peer_agent) if state.peer_agent else None
    if out.ok:
        read = out.read
        if read is not None:
            observer.transfer_done(msg.req_id, state.peer, msg.tp_rank, read.nbytes + state.pre_bytes,
                                   read.seconds, read.descriptors)
            if peer is not None:
                book.read_done(peer, read.nbytes + state.pre_bytes)
        return
    assert out.error is not None
    observer.transfer_failed(msg.req_id, state.peer, msg.tp_rank, out.error.code, out.error.reason)
    if out.peer_failed and peer is not None:
        book.read_failed(peer)  # counted; handshake again before the next read


async def word_again(nixl: NixlPort, observer: Observer, state: RecvState) -> Any:
    """The receive's lease word read again: the claim says it is published, and the landing's
    read did not show it or was not made (None: it cannot be read now either: a claim sent
    after the landing decides)."""
    word = await nixl.read_word(state.peer_agent, state.proof[1]) if state.proof[1] else None
    if (shows := None if word is None else proves(word, state.proof[0], time.time())) is not None:
        observer.lease_word(shows)
    return shows


async def claim_again(claims: Claims, book: PeerBook, state: RecvState) -> RequestError | None:
    """A claim sent after the data landed, when nothing else proved the lease held then (no
    lease word: ``--cuda on``, a slot taken, a word that could not be read): its "held" does
    (None); else why the read is not trusted."""
    peer = book.by_agent(state.peer_agent)
    if peer is None:
        return RequestError(ErrorCode.PEER_DISCONNECTED, "the prefill went away before the read was proven",
                            state.msg.req_id)
    task = claims.start(state.msg, state.remote_engine, max(0.0, state.deadline - time.monotonic()), peer,
                        state.mark, fresh=True, first=state.machine.deferred)
    await asyncio.wait([task])
    return claim_answer(task)[0]


def start_claim(claims: Claims, state: RecvState, peer: Peer, remaining: float,
                words_read: bool = False) -> asyncio.Future[ClaimAnswer] | None:
    """The read's claim, sent now (the machine learns whether the data had landed already: then
    a claim of its own, never another rank's sent before the landing). None: a read in flight
    whose lease word will be read once it landed (``words_read``: host memory) needs none
    (``Receive.claim_deferred``: a claim beside a 16 MiB read, sent from the loop while the
    NIXL thread planned it, cost ~0.3 ms here)."""
    if words_read and state.proof[1] and state.machine.read_in_flight:
        state.machine.claim_deferred()
        return None
    after = state.machine.claim_sent()
    return claims.start(state.msg, state.remote_engine, remaining, peer, state.mark, fresh=after)


def proof_again(word: bool, nixl: NixlPort, observer: Observer, claims: Claims, book: PeerBook,
                state: RecvState) -> tuple[Any, Callable[[Any], Step]]:
    """What proves a landed read now, and the machine's step for its answer: its lease word read
    again (``word``), or a claim sent after the landing."""
    if word:
        return word_again(nixl, observer, state), state.machine.reproved
    return claim_again(claims, book, state), state.machine.reclaimed
