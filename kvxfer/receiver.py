"""The decode side of a sidecar: the receive state machine.

A ``Recv`` becomes one read per (request, local rank): handshake (once per peer, shared),
plan (which remote engine, stages and ranks; ``kvxfer.topology``), the read on the NIXL
thread with its lease *claim* in parallel, an optional integrity check (``--verify-sample``),
then exactly one ``Done`` or ``Failed`` to the engine and a ``ReadNotice`` to the prefill.
States: ``handshake`` -> ``reading`` -> ``verifying`` (claim answer or digests pending).

Dependencies are passed in: the registry (local ranks), the peers (dialer), the NIXL thread
(``transfer`` and ``nixl`` to call it), the observer, ``send`` (to an engine connection),
``spawn`` (a task the sidecar cancels at stop) and ``on_change`` (gauges, idleness).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvxfer.abandoned import Abandoned
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.integrity import digest_items
from kvxfer.observe import Event, Observer
from kvxfer.peers import Peer, Peers, RenewalSent
from kvxfer.protocol import (
    DigestRank,
    DigestRequest,
    Done,
    Error,
    Failed,
    KeepAlive,
    KVLayout,
    LeaseRenew,
    ReadNotice,
    Recv,
    encode,
)
from kvxfer.registry import RankKey, RankRegistry
from kvxfer.sidecar.admission import admit_recv, check_blocks, recv_bytes, recv_deadline_s
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.plan import ReadSpec
from kvxfer.topology import BlockPairing, Incompatible, RankPlan, block_pairing, plan_stages, plan_state

log = logging.getLogger(__name__)


@dataclass
class _RecvState:
    owner: bytes  # where Done / Failed go
    msg: Recv
    nbytes: int  # bytes this rank will receive
    started: float
    deadline: float
    state: str = "handshake"  # -> "reading" -> "verifying" (sampled by --verify-sample)
    peer_agent: str = ""
    local: RankKey | None = None  # the registered rank whose memory receives
    remote_engine: str = ""  # the prefill engine it reads, once the plan named it
    claim: asyncio.Future[RequestError | None] | None = None  # the prefill's "still held": None, or why not
    trace: list[tuple[str, int]] | None = None  # (hop, monotonic ns) when the Recv asked for it

    def mark(self, hop: str) -> None:
        if self.trace is not None:
            self.trace.append((hop, time.monotonic_ns()))

    @property
    def peer(self) -> str:
        return f"{self.msg.remote_host}:{self.msg.remote_port}"


def _local_blocks(msg: Recv) -> list[int]:
    """Every local block a receive writes (its contents are invalid when it fails)."""
    return list(msg.block_ids) + msg.state_pairs[0]


def recv_key(req_id: str, tp_rank: int, engine: str = "", pp_rank: int = 0) -> str:
    """One receive per (request, local rank): each rank reads its own memory."""
    return f"{engine}/{pp_rank}/{tp_rank}:{req_id}"




class Receiver:
    def __init__(self, *, config: Config, registry: RankRegistry, peers: Peers, nixl: NixlPort,
                 observer: Observer, send: Callable[[bytes, Any], None],
                 spawn: Callable[[Any], None], on_change: Callable[[], None], agent_name: str,
                 abandoned: Abandoned | None = None) -> None:
        self.config = config
        self.registry = registry
        self.peers = peers
        self.nixl = nixl
        self.observer = observer
        self._send = send
        self._spawn = spawn
        self._on_change = on_change
        self.agent_name = agent_name
        self.recvs: dict[str, _RecvState] = {}
        self._receives_done = 0  # successful reads so far (1 in verify_sample is checked)
        self.abandoned = abandoned if abandoned is not None else Abandoned()  # (kvxfer.abandoned)

    def __len__(self) -> int:
        return len(self.recvs)

    def on_read_refused(self, event: ReadRefused) -> None:
        """The NIXL thread could not start a read it was handed (nothing was posted)."""
        state = self.recvs.get(event.req_id)
        if state is not None:
            self._fail_recv(event.req_id, event.error)

    def on_read_finished(self, event: ReadFinished) -> None:
        state = self.recvs.get(event.req_id)
        if state is None:
            return
        if state.trace is not None:
            state.trace += event.trace
            state.mark("loop")
        self._read_finished(state, event, self.peers.by_agent(event.peer))

    def _read_finished(self, state: _RecvState, event: ReadFinished, peer: Peer | None) -> None:
        if self.recvs.get(event.req_id) is not state:
            return  # cancelled meanwhile: already reported
        try:
            self.read_finished(state, event, peer)
        except Exception as e:  # a bug must fail this receive, never leave it waiting forever
            log.exception("finishing receive %s", event.req_id)
            self._finish(state, event, peer, RequestError(ErrorCode.INTERNAL, repr(e), state.msg.req_id))

    async def fail_rank(self, key: RankKey, reason: str) -> None:
        """A local rank is gone (its engine died): fail its receives."""
        for rkey, st in list(self.recvs.items()):
            if st.local == key:
                if st.state == "reading":
                    await self.nixl.cancel(rkey, ErrorCode.NOT_REGISTERED, reason)
                else:
                    self._finish_recv_error(rkey, RequestError(ErrorCode.NOT_REGISTERED, reason))

    def _fail(self, ident: bytes, req_id: str, block_ids: list[int], err: RequestError) -> None:
        log.warning("request %s failed: [%s] %s", req_id, err.code, err.reason)
        self._send(ident, Failed(req_id=req_id, block_ids=block_ids, code=err.code, reason=err.reason))

    def on_recv(self, ident: bytes, msg: Recv, draining: bool = False, received_ns: int = 0) -> None:
        engine = self.registry.engine_of(msg.engine_id)
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
                       registered=self.registry.describe())
        except RequestError as e:
            self._fail(ident, msg.req_id, _local_blocks(msg), e)
            return
        assert local is not None
        now = time.monotonic()
        lay = local.layout
        nbytes = recv_bytes(lay, sum(r.block_len for r in local.info.regions[:lay.num_regions]), msg)
        # (never read past the moment the engine gives up on the load)
        deadline_s = recv_deadline_s(msg, wall, self.config.transfer_timeout_s)
        msg = msgspec.structs.replace(msg, deadline_s=deadline_s)
        self.recvs[key] = state = _RecvState(
            owner=ident, msg=msg, nbytes=nbytes, started=now, deadline=now + msg.deadline_s, local=local.key,
        )
        if msg.trace:
            state.trace = [("sidecar", received_ns or time.monotonic_ns())]
            state.mark("accepted")
        self._on_change()
        # The hot path: a peer already handshaked (and of the generation the request names)
        # is planned and posted now, in this call, with no task and no await in between.
        peer = self.peers.cached_peer(msg.remote_host, msg.remote_port, msg.remote_generation)
        if peer is not None:
            try:
                self._check_generation(msg, peer)
                plans, pairing = self._plan(msg, peer, state)
                self._start_read(key, state, peer, plans, pairing,
                                 msg.deadline_s or self.config.transfer_timeout_s)
                return
            except Exception as e:
                if not self._may_be_stale(e, msg):
                    self._fail_recv(key, e)
                    return  # (missing ranks, or a stale description: handshake again below)
        self._spawn(self._run_recv(key, msg))

    @staticmethod
    def _may_be_stale(err: BaseException, msg: Recv) -> bool:
        """A plan failed in a way a fresh handshake may cure: ranks missing from it, or (for a
        request that names no generation, which would have caught it) a layout that no longer
        matches because the prefill engine re-registered since."""
        return isinstance(err, RequestError) and (
            err.code == ErrorCode.NOT_REGISTERED
            or (err.code == ErrorCode.INCOMPATIBLE and not msg.remote_generation))

    async def _run_recv(self, key: str, msg: Recv) -> None:
        """A receive whose peer must be handshaked first (or again)."""
        start = time.monotonic()
        deadline_s = msg.deadline_s or self.config.transfer_timeout_s
        state = self.recvs[key]
        try:
            peer = await asyncio.wait_for(
                self.peers.current_peer(msg.remote_host, msg.remote_port, msg.remote_generation),
                timeout=deadline_s,
            )
            if self.recvs.get(key) is not state:
                return  # cancelled or failed while the handshake ran
            state.mark("handshaked")
            self._check_generation(msg, peer)
            try:
                plans, pairing = self._plan(msg, peer, state)
            except RequestError as e:
                if not self._may_be_stale(e, msg):
                    raise
                if e.code == ErrorCode.INCOMPATIBLE and not await self._generation_moved(msg, peer):
                    raise e from None  # nothing is stale: the request does not fit this peer
                peer.stale = True  # ranks missing, or a stale description: ask again once
                peer = await asyncio.wait_for(self.peers.get_peer(msg.remote_host, msg.remote_port),
                                              timeout=deadline_s)
                if self.recvs.get(key) is not state:
                    return  # cancelled (and reported) while it handshaked again: never read
                self._check_generation(msg, peer)
                plans, pairing = self._plan(msg, peer, state)
            self._start_read(key, state, peer, plans, pairing, deadline_s - (time.monotonic() - start))
        except TimeoutError:
            self._finish_recv_error(
                key, RequestError(ErrorCode.HANDSHAKE_FAILED, f"no handshake within {deadline_s}s")
            )
        except Exception as e:
            self._fail_recv(key, e)

    async def _generation_moved(self, msg: Recv, peer: Peer) -> bool:
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

    def _fail_recv(self, key: str, err: BaseException) -> None:
        """Fail a receive that could not start: its RequestError, or a bug as TRANSFER_ERROR."""
        if not isinstance(err, RequestError):
            state = self.recvs.get(key)
            log.error("receive %s failed", state.msg.req_id if state else key, exc_info=err)
            err = RequestError(ErrorCode.TRANSFER_ERROR, repr(err))
        self._finish_recv_error(key, err)

    def _start_read(self, key: str, state: _RecvState, peer: Peer, plans: list[RankPlan],
                    pairing: BlockPairing, remaining: float) -> None:
        """Planned: claim the lease and start the read (no await: a ReadFinished event
        answers, or the exception of a refused submission)."""
        msg = state.msg
        state.peer_agent = peer.agent_name
        state.mark("planned")
        if not msg.block_ids and not msg.state_block_ids:
            # Nothing to read (full prefix hit / abort): just release the prefill side.
            self.recvs.pop(key, None)
            self._on_change()
            self._send(state.owner, Done(req_id=msg.req_id, nbytes=0, seconds=0.0))
            self._spawn(self._notify_peer(peer.agent_name, self._notice(state, ok=True)))
            return
        if remaining <= 0:
            self._finish_recv_error(key, RequestError(ErrorCode.DEADLINE, "deadline passed during handshake"))
            return
        state.state = "reading"
        # The claim: the prefill confirms it still holds the blocks and extends the lease
        # over the whole read, in parallel with it; Done waits for the answer, and a lease
        # that was already over fails the load (the blocks may hold another request's KV).
        renew = self._renewal(msg, state, remaining)
        sent = self.peers.send_renewal(msg.remote_host, msg.remote_port, renew)  # now, before the read
        if sent is not None:
            state.mark("claim_sent")
        state.claim = asyncio.ensure_future(self._claim(msg, state, remaining, renew, sent, peer))
        # The prefill side must not let its lease run out under a read in progress: the
        # thread that posts the first chunk tells it right after (it must not delay the read).
        started = ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=True,
                             reading_s=remaining, engine_id=state.remote_engine, pp_rank=msg.pp_rank,
                             token=msg.remote_token)
        spec = ReadSpec(req_id=key, peer=peer.agent_name, local_rank=state.local,
                        local_blocks=list(msg.block_ids), remote_blocks=list(msg.remote_block_ids),
                        plans=plans, pairing=pairing, deadline_s=remaining, started_notice=encode(started),
                        remote_engine=state.remote_engine, state_blocks=msg.state_pairs,
                        trace=state.trace is not None)
        # A small read is posted (and on one host copied) in this call, with no hand-off to
        # the NIXL thread and back (the port's choice); its end comes as a ReadFinished.
        try:
            self.nixl.read(spec)
        except Exception as e:
            self._fail_recv(key, e)

    def _check_generation(self, msg: Recv, peer: Peer) -> None:
        if peer.outdated_by(msg.remote_generation):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"the prefill sidecar re-registered since "
                               f"these blocks were held (generation {msg.remote_generation}, now "
                               f"{peer.generation}); not reading stale memory")

    def _plan(self, msg: Recv, peer: Peer, state: _RecvState) -> tuple[list[RankPlan], BlockPairing]:
        """Which remote ranks (of which engine and pipeline stage) to read, and how blocks
        pair up (kvxfer.topology); names the remote engine in ``state``."""
        engine = peer.resolve_engine(msg.remote_engine_id)
        state.remote_engine = engine
        entry = self.registry.get(state.local) if state.local is not None else None
        if entry is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"local rank {state.local} was unregistered")
        local = entry.layout
        ranks = peer.engine_ranks(engine)
        remote = next(iter(ranks.values())).layout
        if msg.remote_tp_size != remote.tp_size:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"request says remote tp_size {msg.remote_tp_size}, peer has {remote.tp_size}",
            )
        stages: dict[int, KVLayout] = {}
        for (pp, _tp), info in sorted(ranks.items()):
            stages.setdefault(pp, info.layout)
        try:
            plans = plan_stages(local, stages) + plan_state(local, remote)
            pairing = block_pairing(local, remote)
            if msg.block_ids:
                pairing.pairs(len(msg.block_ids), len(msg.remote_block_ids))
        except Incompatible as e:
            if len(stages) < remote.pp_size:
                raise RequestError(ErrorCode.NOT_REGISTERED, f"peer has {len(stages)} of {remote.pp_size} "
                                   f"pipeline stages of engine {engine!r} registered: {e}") from None
            raise RequestError(ErrorCode.INCOMPATIBLE, str(e)) from None
        for plan in plans:
            info = ranks.get((plan.remote_pp, plan.remote_rank))
            if info is None:
                raise RequestError(
                    ErrorCode.NOT_REGISTERED,
                    f"peer has {len(ranks)} of {remote.tp_size * remote.pp_size} ranks of engine {engine!r} "
                    f"registered; pp{plan.remote_pp}/tp{plan.remote_rank} is missing",
                )
            check_blocks(msg.req_id, msg.state_pairs[1] if plan.state else msg.remote_block_ids,
                         info.layout.num_blocks, "remote")
        return plans, pairing

    def _finish_recv_error(self, key: str, err: RequestError) -> None:
        state = self.recvs.pop(key, None)
        if state is not None:
            self.observer.transfer_failed(
                state.msg.req_id, state.peer, state.msg.tp_rank, err.code, err.reason
            )
            self._fail(state.owner, state.msg.req_id, _local_blocks(state.msg), err)
            self._on_change()

    def _notice(self, state: _RecvState, ok: bool) -> ReadNotice:
        """The read notice for the prefill: every (pp, tp) rank of this engine reads once."""
        msg = state.msg
        entry = self.registry.get(state.local) if state.local is not None else None
        readers = entry.layout.tp_size * entry.layout.pp_size if entry is not None else 0
        return ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=ok,
                          readers=readers, engine_id=state.remote_engine, pp_rank=msg.pp_rank,
                          token=msg.remote_token)

    # ------------------------------------------------------------------ NIXL events

    def read_finished(self, state: _RecvState, event: ReadFinished, peer: Peer | None) -> None:
        """A read landed: once the prefill confirmed its lease (the claim), verify a sample,
        then report."""
        claim = state.claim
        if event.ok and claim is not None:
            if not claim.done():
                state.state = "verifying"  # still in flight: drain waits for it, cancel fails it
                claim.add_done_callback(lambda _claim: self._read_finished(state, event, peer))
                return
            err = (RequestError(ErrorCode.EXPIRED, "claim cancelled") if claim.cancelled()
                   else claim.result() if not claim.exception()
                   else RequestError(ErrorCode.EXPIRED, f"claim failed: {claim.exception()!r}"))
            if err is not None:
                self._finish(state, event, peer, RequestError(err.code, err.reason, state.msg.req_id))
                return
        if event.ok and peer is not None and self._sample(peer):
            state.state = "verifying"
            self._spawn(self._verify(state, event, peer))
            return
        self._finish(state, event, peer)

    def _renewal(self, msg: Recv, state: _RecvState, reading_s: float) -> LeaseRenew:
        """The claim's renewal: the lease extended over the read and its verification."""
        return LeaseRenew(seq=0, engine_id=state.remote_engine, req_ids=[msg.remote_req_id or msg.req_id],
                          extend_s=reading_s + self.config.handshake_timeout_s + 1.0,
                          agent_name=self.agent_name, tokens=[msg.remote_token])

    async def _claim(self, msg: Recv, state: _RecvState, reading_s: float, renew: LeaseRenew,
                     sent: RenewalSent | None = None, peer: Peer | None = None) -> RequestError | None:
        """Ask the prefill whether it still holds the blocks, extending the lease over the read
        and its verification (None when held; else why the read must not be trusted). ``sent``:
        the first ask, already on its way; ``peer``: what the read was planned from."""
        timeout = self.config.handshake_timeout_s
        # An answer may take as long as the read it vouches for (a loaded prefill sidecar
        # answers late, not wrongly), and no less than a handshake; a Hold still on its way
        # is waited for one handshake timeout.
        now = time.monotonic()
        end, unknown_end = now + max(timeout, reading_s), now + timeout
        pause = 0.002
        while True:
            try:
                if sent is not None:
                    got = await self.peers.renewal_answer(sent, max(0.05, end - time.monotonic()))
                    sent = None
                else:
                    state.mark("claim_sent")
                    got = await self.peers.call_peer(msg.remote_host, msg.remote_port, renew,
                                                     max(0.05, end - time.monotonic()))
            except RequestError as e:
                return RequestError(ErrorCode.EXPIRED, f"the prefill did not confirm it still holds the "
                                    f"blocks: {e.reason}")
            except Exception as e:  # never leave a read waiting on a claim that raised
                log.exception("claim of %s failed", msg.req_id)
                return RequestError(ErrorCode.EXPIRED, f"the prefill did not confirm it still holds the "
                                    f"blocks: {e!r}")
            answer = got.held[0] if got.held else "unknown"
            if answer == "held":
                state.mark("claimed")
                if not msg.remote_generation and peer is not None and peer.outdated_by(got.generation):
                    # A request that names no generation was planned from a cached handshake
                    # older than the prefill's registrations. (One that names it was checked
                    # against the handshake it was planned from.) The generation is the whole
                    # sidecar's: another engine's re-registration fails this read too.
                    peer.stale = True  # the next receive handshakes again
                    return RequestError(ErrorCode.INCOMPATIBLE, f"the prefill sidecar re-registered since "
                                        f"it was handshaked (generation {peer.generation}, now "
                                        f"{got.generation}): this read followed its old memory "
                                        "description; not used")
                return None
            if answer == "gone":
                break
            # Not held *yet*: its Hold may still be on the way to the prefill sidecar (the
            # engine keeps the blocks meanwhile). Ask again, briefly.
            if time.monotonic() + pause > min(end, unknown_end):
                return RequestError(ErrorCode.EXPIRED, "the prefill sidecar does not hold this request "
                                    "(its Hold never arrived)")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        self.observer.emit(Event("lease_expired_before_read", request_id=msg.req_id, peer=state.peer))
        return RequestError(ErrorCode.EXPIRED, "the prefill's lease on these blocks was over before the "
                            "read: they may already hold another request's KV; not used")

    async def keepalive(self, ident: bytes, msg: KeepAlive) -> None:
        """Renew the prefill leases of requests still waiting here (handshaking first: the
        read that follows then starts warm); tell the engine which leases are gone."""
        if len(msg.req_ids) != len(msg.remote_req_ids) or (
                msg.remote_tokens and len(msg.remote_tokens) != len(msg.req_ids)):
            self._send(ident, Error(code=ErrorCode.MALFORMED, message="keepalive: req_ids, "
                                    "remote_req_ids and remote_tokens differ in length"))
            return
        timeout = self.config.handshake_timeout_s
        try:
            peer = await asyncio.wait_for(self.peers.get_peer(msg.remote_host, msg.remote_port), 2 * timeout)
            engine = peer.resolve_engine(msg.remote_engine_id)
            renew = LeaseRenew(seq=0, engine_id=engine, req_ids=list(msg.remote_req_ids),
                               agent_name=self.agent_name, tokens=list(msg.remote_tokens))
            got = await self.peers.call_peer(msg.remote_host, msg.remote_port, renew, timeout)
        except (RequestError, TimeoutError) as e:
            log.info("keep-alive of %d leases at %s:%d not delivered: %s", len(msg.req_ids), msg.remote_host,
                     msg.remote_port, e)
            return
        if peer.outdated_by(got.generation):
            peer.stale = True  # its registrations changed: the read that follows handshakes first
        for local, held in zip(msg.req_ids, got.held, strict=False):
            if held == "gone":
                self._send(ident, Error(code=ErrorCode.EXPIRED, req_id=local,
                                        message="the prefill's lease on this request's blocks is over"))

    def _finish(self, state: _RecvState, event: ReadFinished, peer: Peer | None,
                failure: RequestError | None = None) -> None:
        """Report a finished read to the engine (``failure`` overrides a successful one), then
        tell the prefill side it may release its blocks."""
        if self.recvs.get(event.req_id) is not state:
            return  # cancelled while it was being verified: already reported
        del self.recvs[event.req_id]
        msg = state.msg
        ok = event.ok and failure is None
        notice = self._notice(state, ok)
        if ok:
            # the engine first: metrics and events can wait a few microseconds
            state.mark("reply")
            self._send(state.owner, Done(req_id=msg.req_id, nbytes=event.nbytes, seconds=event.seconds,
                                         descriptors=event.descriptors,
                                         trace=None if state.trace is None
                                         else sorted(state.trace, key=lambda h: h[1])))
            self.observer.transfer_done(msg.req_id, state.peer, msg.tp_rank, event.nbytes,
                                        event.seconds, event.descriptors)
            if peer is not None:
                peer.reads += 1
                peer.bytes += event.nbytes
        else:
            err = failure or RequestError(event.code, event.reason, msg.req_id)
            self.observer.transfer_failed(msg.req_id, state.peer, msg.tp_rank, err.code, err.reason)
            if peer is not None:
                peer.failures += 1
                peer.stale = True  # any failed read: handshake again before the next one
            self._fail(state.owner, msg.req_id, _local_blocks(msg), err)
        self._on_change()
        if event.code == ErrorCode.PEER_DISCONNECTED:
            self._spawn(self.peers.drop_peer(event.peer, event.reason))
        else:
            self._spawn(self._notify_peer(event.peer, notice))

    def _sample(self, peer: Peer) -> bool:
        """Verify this read? The first one from each peer (a wrong layout shows at once), then
        one in ``verify_sample``."""
        n = self.config.verify_sample
        if n <= 0:
            return False
        self._receives_done += 1
        if not peer.verified or self._receives_done % n == 0:
            peer.verified = True
            return True
        return False

    async def _verify(self, state: _RecvState, event: ReadFinished, peer: Peer) -> None:
        """Digest the received bytes here and the same bytes at the prefill, which still holds
        them (its lease runs until our read notice); a mismatch fails the load."""
        msg = state.msg
        t0 = time.monotonic()
        try:
            plans, pairing = self._plan(msg, peer, state)
            items = digest_items(plans, pairing, list(msg.block_ids), list(msg.remote_block_ids),
                                 msg.state_pairs)
            ranks = sorted(items)
            req = DigestRequest(
                req_id=msg.remote_req_id or msg.req_id, agent_name=self.agent_name,
                engine_id=state.remote_engine, token=msg.remote_token,
                ranks=[DigestRank(rank=key[1], items=items[key][1], pp_rank=key[0],
                                  region0=items[key][2].remote_region0,
                                  num_regions=items[key][2].num_regions) for key in ranks])
            timeout = self.config.handshake_timeout_s
            remote, local = await asyncio.gather(
                self.peers.request_digest(msg.remote_host, msg.remote_port, req, timeout),
                asyncio.gather(*(self.nixl.digest(state.local, items[r][0], items[r][2].local_region0,
                                                  items[r][2].num_regions)
                                 for r in ranks)),
            )
        except Exception as e:
            # Not a verdict on the bytes: the read itself succeeded.
            log.warning("receive %s from %s not verified: %s", msg.req_id, state.peer, e)
            self.observer.integrity_checked("unverified", time.monotonic() - t0)
            self._finish(state, event, peer)
            return
        took = time.monotonic() - t0
        if list(local) == list(remote):
            self.observer.integrity_checked("ok", took)
            self._finish(state, event, peer)
            return
        entry = self.registry.get(state.local) if state.local is not None else None
        local_layout = entry.layout if entry is not None else None
        remote_layout = next(iter(peer.engine_ranks(state.remote_engine).values())).layout
        log.error("integrity: receive %s (rank %d) from %s: decode digests %s != prefill digests %s; "
                  "decode layout %s; prefill layout %s; the load fails and is recomputed",
                  msg.req_id, msg.tp_rank, state.peer, list(local), list(remote), local_layout, remote_layout)
        self.observer.integrity_failure(msg.req_id, state.peer, msg.tp_rank, list(local), list(remote), took)
        self._finish(state, event, peer, RequestError(
            ErrorCode.INTEGRITY, f"received bytes differ from the prefill's (digests {list(local)} vs "
                                 f"{list(remote)})", msg.req_id))

    async def _notify_peer(self, agent: str, notice: ReadNotice) -> None:
        try:
            await self.nixl.notify(agent, encode(notice))
        except Exception as e:
            log.warning("read notice for %s to %s not sent: %s", notice.req_id, agent, e)

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED,
                     reason: str = "cancelled by operator") -> int:
        """Fail every rank's receive of a request now; returns how many were cancelled."""
        keys = [k for k, st in self.recvs.items() if st.msg.req_id == req_id or not req_id]
        for key in keys:
            state = self.recvs.get(key)
            if state is None:
                continue
            if state.state == "reading" and await self.nixl.cancel(key, code, reason):
                continue  # the NIXL thread reports the failure through the usual path
            self._finish_recv_error(key, RequestError(code, reason, req_id))
        return len(keys)

