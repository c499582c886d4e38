"""The listening side of the peer conversation (prefill side): the handshake listener
answers a ``Hello`` with a ``Welcome`` (this sidecar's ranks and NIXL metadata), routes
lease renewals to the holds and digest requests to the registered memory.

The compatibility hash is checked before any payload is used; the NIXL agent metadata
travels as its own frame. With a shared secret (``kvxfer.auth``): a hello must answer this
listener's challenge, the welcome is MAC'd, the listener is a CurveZMQ server of keys that
derive from the secret, and renewals and digest requests are answered only for signed
requests of agents that completed such a handshake here (``Authenticated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from kvxfer.auth import ChallengeBook, check_request, sign_welcome
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    Challenge,
    DigestReply,
    DigestRequest,
    HandshakeRequest,
    Hello,
    LayersAt,
    LayerWatch,
    LeaseRenew,
    LeaseState,
    Refused,
    Staged,
    StageRequest,
    Welcome,
    compat_hash,
    compat_tp_hash,
    encode,
    handshake_request_decoder,
    hashes_match,
)
from kvxfer.sidecar.admission import admit_digest
from kvxfer.sidecar.holds import Holds
from kvxfer.sidecar.nixl_port import NixlPort, offered_staging
from kvxfer.sidecar.nixl_types import NoticeReceived
from kvxfer.sidecar.peer_book import Authenticated
from kvxfer.sidecar.peer_client import PeerChannel
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.sidecar.stage_server import StageServer
from kvxfer.sidecar.staging import Books
from kvxfer.sidecar.stream_server import StreamServer

log = logging.getLogger("kvxfer.peers")

# Peer requests the listener answers at once (beyond this, it reads no more until one ends).
LISTENER_CONCURRENCY = 64
LISTENER_TURN_S = 1e-3  # the listener lets the loop turn at least this often while messages keep coming

Answer = tuple[Welcome | Refused | DigestReply | LeaseState | Challenge | Staged, list[bytes]]


def peer_address(frame: zmq.Frame) -> str:
    """The sending peer's IP address as ZMQ saw it ("" when the transport has none)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, ValueError):
        return ""


class PeerServer:
    def __init__(self, *, channel: PeerChannel, registry: RankRegistry, holds: Holds, nixl: NixlPort,
                 observer: Observer, authenticated: Authenticated, generation: Callable[[], str],
                 lease_words: tuple[int, int] = (0, 0), streams: StreamServer | None = None,
                 books: Books | None = None) -> None:
        self.channel = channel
        self.streams = streams  # (push mode: LayerWatch)
        self.lease_words = lease_words  # (address, slots) advertised in every Welcome
        self.registry = registry
        self.holds = holds
        self.nixl = nixl
        self.observer = observer
        self.authenticated = authenticated
        self._generation = generation  # this sidecar's registrations now (Welcome.generation)
        self.stager = StageServer(holds=holds, registry=registry, nixl=nixl, generation=generation,  # (staged
                                  books=books)  # reads: StageRequest)
        self.challenges = ChallengeBook(channel.agent_name)
        self._tasks: set[asyncio.Task[None]] = set()

    def on_notice(self, ev: NoticeReceived) -> None:
        """A peer's NIXL notification (a ``ReadNotice``): its lease, and its staging slot."""
        self.holds.on_notice(ev.agent, ev.payload)
        self.stager.on_notice(ev.agent, ev.payload)

    def configure(self, sock: zmq.asyncio.Socket) -> None:
        """Before bind: make the handshake listener a CurveZMQ server (with a secret)."""
        if self.channel.curve is not None:
            sock.curve_publickey, sock.curve_secretkey = self.channel.curve
            sock.curve_server = True

    async def serve(self, sock: zmq.asyncio.Socket) -> None:
        """Answer every request on the handshake listener. A lease renewal (the claim of a
        read in progress: the read's Done waits for it) is answered here and now; every
        other request on its own (at most LISTENER_CONCURRENCY at once), so none queues
        behind a handshake or a digest waiting on the NIXL thread. Past that many, a request
        is answered "busy" at once: the listener never stops reading, or the renewals behind
        would go unanswered and the readers would judge this sidecar stalled."""
        slots = asyncio.Semaphore(LISTENER_CONCURRENCY)

        async def answer(ident: bytes, request: HandshakeRequest | Exception, addr: str) -> None:
            try:
                reply, extra = await self._answer(request, addr)
                with contextlib.suppress(zmq.ZMQError):
                    await sock.send_multipart([ident, encode(reply), *extra])
            except Exception:
                log.exception("answering a peer failed")
            finally:
                slots.release()

        turn = time.monotonic()
        try:
            while True:
                if time.monotonic() - turn > LISTENER_TURN_S:  # (a message already queued is taken
                    await asyncio.sleep(0)  # without a turn of the loop: a peer's flood of renewals
                    turn = time.monotonic()  # held every engine and peer: found by a review)
                frames = await sock.recv_multipart(copy=False)
                request: HandshakeRequest | Exception
                try:
                    request = handshake_request_decoder.decode(frames[-1].bytes)
                except DECODE_ERRORS as e:
                    request = e  # (answered, and counted, as a bad hello)
                if isinstance(request, LeaseRenew):
                    renewal = self._answer_renewal(request, frames[-1])
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send_multipart([frames[0].bytes, encode(renewal)], flags=zmq.NOBLOCK)
                    continue
                if isinstance(request, LayerWatch):  # (waits in the stream server, not in a slot)
                    self._watch(sock, frames[0].bytes, request, frames[-1])
                    continue
                if slots.locked():
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send_multipart([frames[0].bytes, encode(self._busy(request, frames[-1]))],
                                            flags=zmq.NOBLOCK)
                    continue
                await slots.acquire()  # (free: it does not wait)
                task = asyncio.ensure_future(answer(frames[0].bytes, request, peer_address(frames[-1])))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for task in self._tasks:
                task.cancel()

    # ---------------------------------------------------------------- answers

    def _busy(self, request: HandshakeRequest | Exception, frame: zmq.Frame) -> Staged | Refused:
        """The answer to a request that finds every slot taken: a staged read reads directly
        (``busy``), anything else is refused and tried again by its next request."""
        if isinstance(request, StageRequest):
            return Staged(seq=request.seq, held="busy")
        self.observer.handshake_refused(peer_address(frame), ErrorCode.BUSY)
        why = f"{LISTENER_CONCURRENCY} requests wait for this sidecar's NIXL thread; try again"
        return Refused(version=PROTOCOL_VERSION, code=ErrorCode.BUSY, reason=why)

    def _answer_renewal(self, msg: LeaseRenew, frame: zmq.Frame) -> LeaseState | Refused:
        """The answer to a ``LeaseRenew``, given in the listener's loop."""
        why = self._unsigned(msg)
        if why:
            refused, _ = self._refuse(peer_address(frame), msg.agent_name or "?", ErrorCode.UNAUTHORIZED, why)
            assert isinstance(refused, Refused)
            return refused
        state = self._renew(msg)
        if "held" in state.held:
            self.nixl.expect_reads()  # (a claim: the read follows; see NixlPort.expect_reads)
        return state

    def _watch(self, sock: zmq.asyncio.Socket, ident: bytes, msg: LayerWatch, frame: zmq.Frame) -> None:
        """A decode's ``LayerWatch``: answered by the stream server, now or later."""

        def reply(answer: LayersAt | Refused) -> None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([ident, encode(answer)], flags=zmq.NOBLOCK)

        why = self._unsigned(msg)
        if why:
            reply(self._refuse(peer_address(frame), msg.agent_name or "?", ErrorCode.UNAUTHORIZED, why)[0])
            return
        if self.streams is None:
            reply(LayersAt(seq=msg.seq, held="refused", code=ErrorCode.INCOMPATIBLE,
                           reason="this sidecar does not serve push mode"))
            return
        self.streams.watch(msg, reply)

    def _renew(self, msg: LeaseRenew) -> LeaseState:
        """Extend the leases; the answer names this sidecar's generation, so that a reader
        whose request named none still learns that its plan came from stale descriptions."""
        return msgspec.structs.replace(self.holds.renew(msg), generation=self._generation())

    def _unsigned(self, msg: DigestRequest | LeaseRenew | StageRequest | LayerWatch) -> str:
        """Why a signed request is refused here ("": it is not)."""
        if not self.channel.secret:
            return ""
        if not check_request(self.channel.secret, msg):
            return f"{type(msg).__name__} without a valid signature"
        if not self.authenticated(msg.agent_name):
            return (f"{type(msg).__name__} from an agent that did not complete an authenticated "
                    "handshake here")
        return ""

    def _refuse(self, addr: str, sender: str, code: ErrorCode, reason: str) -> Answer:
        log.warning("handshake refused (from %s%s): %s", addr or "?", f", {sender}" if sender else "", reason)
        self.observer.handshake_refused(f"{addr} {sender}".strip(), code)
        return Refused(version=PROTOCOL_VERSION, code=code, reason=reason), []

    async def _answer(self, request: HandshakeRequest | Exception, addr: str = "") -> Answer:
        """The answer to a handshake request, decoded once by the listener (an exception: it
        did not decode)."""
        if isinstance(request, Exception):
            self.observer.bad_message("handshake")
            return self._refuse(addr, "", ErrorCode.MALFORMED, f"bad hello: {request}")
        sender = f"{request.agent_name or '?'}"
        signed = isinstance(request, DigestRequest | LeaseRenew | StageRequest)
        if signed and (why := self._unsigned(request)):
            return self._refuse(addr, sender, ErrorCode.UNAUTHORIZED, why)
        if isinstance(request, StageRequest):
            return await self.stager.answer(request), []
        if isinstance(request, DigestRequest):
            try:
                return await self._answer_digest(request), []
            except RequestError as e:
                return self._refuse(addr, sender, e.code, f"digest of {request.req_id!r}: {e.reason}")
        if isinstance(request, LeaseRenew):
            return self._renew(request), []
        return await self._answer_hello(request, addr)

    async def _answer_hello(self, hello: Hello, addr: str) -> Answer:
        sender = f"{hello.agent_name!r} of engine {hello.engine_id!r}"
        secret = self.channel.secret
        if secret:
            if not hello.mac:  # step one: prove you hold the secret, answering this challenge
                return Challenge(version=PROTOCOL_VERSION, nonce=self.challenges.issue(),
                                 agent_name=self.channel.agent_name), []
            why = self.challenges.check_hello(secret, hello)
            if why is not None:
                return self._refuse(addr, sender, ErrorCode.UNAUTHORIZED, why)
        if hello.version != PROTOCOL_VERSION:
            return self._refuse(addr, sender, ErrorCode.INCOMPATIBLE, f"protocol version {hello.version}, "
                                f"this sidecar speaks {PROTOCOL_VERSION}")
        layout = self.registry.first_layout()
        if layout is None:
            return self._refuse(addr, sender, ErrorCode.NOT_REGISTERED, "no KV cache registered yet")
        ours, ours_tp = compat_hash(layout), compat_tp_hash(layout)
        if not hashes_match(ours, ours_tp, hello.compat_hash, hello.compat_tp):
            why = (f"different models: the peer serves {hello.model or '(unnamed)'!r}, this engine "
                   f"{layout.model or '(unnamed)'!r}" if hello.model != layout.model else
                   f"compatibility hash {hello.compat_hash} != {ours} (model layout differs: "
                   f"{layout.model_signature()})")
            return self._refuse(addr, sender, ErrorCode.INCOMPATIBLE, why)
        # What is offered is read before the metadata is: a rank (and its device's staging arena)
        # registered during that await is then in the metadata, never offered without it
        ranks, generation, staging = self.registry.infos(), self._generation(), offered_staging(self.nixl)
        metadata = await self.nixl.metadata()
        welcome = Welcome(version=PROTOCOL_VERSION, compat_hash=ours, compat_tp=ours_tp,
                          engine_id=self.channel.engine_id,
                          agent_name=self.channel.agent_name, ranks=ranks,
                          generation=generation,
                          staging_bytes=staging, lease_words_addr=self.lease_words[0],
                          lease_words_slots=self.lease_words[1], layer_streams=self.streams is not None,
                          grouped_streams=self.streams is not None, chunk_streams=self.streams is not None,
                          reader_engines=True)
        if secret:
            welcome = sign_welcome(secret, welcome, hello, metadata)
            self.authenticated.add(hello.agent_name)
        log.info("handshake from %s (%s) accepted: %d ranks offered", addr or "?", sender, len(welcome.ranks))
        self.observer.handshake_accepted(hello.agent_name, hello.engine_id)
        return welcome, [metadata]

    async def _answer_digest(self, req: DigestRequest) -> DigestReply:
        """The digest of bytes a peer read from blocks we still hold for it. Only blocks of a
        held lease can be digested, so a request costs no more than the read it checks."""
        lease = self.holds.lease_for(req.agent_name, req.engine_id, req.req_id, req.token, "digest")
        if lease is None:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, "no blocks held for this request (lease over?)")

        def block_len(pp: int, tp: int, region0: int) -> int | None:
            entry = self.registry.find(lease.engine, pp, tp)
            if entry is None:
                return None
            regions = entry.info.regions
            return regions[region0].block_len if region0 < len(regions) else 0

        admit_digest(req, set(lease.block_ids), len(self.registry.of_engine(lease.engine)), block_len)
        digests = []
        for r in req.ranks:
            entry = self.registry.find(lease.engine, r.pp_rank, r.rank)
            if entry is None:  # (unregistered while an earlier rank was digested)
                raise RequestError(ErrorCode.NOT_REGISTERED,
                                   f"rank pp{r.pp_rank}/tp{r.rank} is not registered")
            digests.append(await self.nixl.digest(entry.key, r.items, r.region0, r.num_regions))
        return DigestReply(req_id=req.req_id, digests=digests)
