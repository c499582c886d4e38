"""Peer sidecars: the handshake, both as the listener (prefill side answers ``Hello``)
and as the dialer (decode side, once per peer endpoint, shared by concurrent requests).

``Peers`` gets what it uses passed in (a ZMQ context for dialing, the registry of local
ranks, the NIXL thread, the observer, the holds it answers digests and renewals for) and
keeps ``peers`` (by handshake endpoint). The
compatibility hash is checked in both directions before any payload is used; the NIXL
agent metadata travels as its own frame.

With a shared secret (``kvxfer.auth``): the handshake is challenge-bound and MAC'd both
ways, the listener is a CurveZMQ server whose keys derive from the secret (the channel,
NIXL metadata included, is encrypted), and lease renewals and digest requests are answered
only for agents that completed such a handshake here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvxfer.auth import (
    ChallengeBook,
    check_request,
    check_welcome,
    curve_server_keys,
    sign_hello,
    sign_request,
    sign_welcome,
)
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    Challenge,
    DigestReply,
    DigestRequest,
    HandshakeRequest,
    Hello,
    LeaseRenew,
    LeaseState,
    RankInfo,
    Refused,
    Welcome,
    compat_hash,
    encode,
    handshake_reply_decoder,
    handshake_request_decoder,
)
from kvxfer.sidecar.admission import admit_digest
from kvxfer.sidecar.validate import validate_rank_info

if TYPE_CHECKING:
    from collections.abc import Callable

    import zmq.asyncio

    from kvxfer.config import Config
    from kvxfer.holds import Holds
    from kvxfer.observe import Observer
    from kvxfer.registry import RankRegistry
    from kvxfer.sidecar.nixl_port import NixlPort

log = logging.getLogger(__name__)


def peer_address(frame: zmq.Frame) -> str:
    """The sending peer's IP address as ZMQ saw it ("" when the transport has none)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, ValueError):
        return ""


@dataclass
class Peer:
    endpoint: str  # host:port of its handshake listener
    engine_id: str
    agent_name: str
    ranks: dict[tuple[str, int, int], RankInfo]  # by (engine, pp, tp): RankInfo.key
    handshake_s: float
    connected_unix: float
    reads: int = 0
    bytes: int = 0
    failures: int = 0
    verified: bool = False  # a read from it was integrity-checked (--verify-sample)
    generation: str = ""  # its registrations when it answered (Welcome.generation)
    stale: bool = False  # handshake again before the next read (a read failed, ranks missing)

    def outdated_by(self, generation: str) -> bool:
        """Both generations known and different: this description came from another
        generation of the peer's registrations than ``generation``."""
        return bool(generation) and bool(self.generation) and self.generation != generation

    def engines(self) -> list[str]:
        return sorted({k[0] for k in self.ranks})

    def engine_ranks(self, engine: str) -> dict[tuple[int, int], RankInfo]:
        """(pp, tp) -> rank of one engine this peer serves."""
        return {(pp, tp): info for (e, pp, tp), info in self.ranks.items() if e == engine}

    def resolve_engine(self, wanted: str) -> str:
        """The engine a request names: an engine id this peer serves; with its sidecar's own
        id (older kv_transfer_params) or none at all, the one engine if it serves only one."""
        engines = self.engines()
        if wanted in engines:
            return wanted
        if (not wanted or wanted == self.engine_id) and len(engines) == 1:
            return engines[0]
        raise RequestError(ErrorCode.UNKNOWN_PEER, f"{self.endpoint} serves engines {engines}, not "
                           f"{wanted!r}")


# Peer requests the listener answers at once (beyond this, it reads no more until one ends).
LISTENER_CONCURRENCY = 64


class PeerLink:
    """One DEALER connection to a peer's handshake listener for small request/reply calls
    (lease renewals: one per read, so no connect per call). Replies are matched by ``seq``."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[LeaseState]] = {}
        self.closed = False

    async def call(self, req: LeaseRenew, timeout_s: float, secret: bytes = b"") -> LeaseState:
        return await self.answer(self.send(req, secret), timeout_s)

    def send(self, req: LeaseRenew, secret: bytes = b"") -> tuple[int, asyncio.Future[LeaseState]]:
        """Send now (not at the caller's next await); ``answer`` waits for the reply."""
        self._seq += 1
        seq = self._seq
        req = msgspec.structs.replace(req, seq=seq)
        if secret:  # signed after the seq is set: the signature covers every field
            req = sign_request(secret, req)
        fut: asyncio.Future[LeaseState] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut

        def sent(f: asyncio.Future[Any]) -> None:  # (pyzmq sends at once and reports in a future)
            e = None if f.cancelled() else f.exception()
            if e is not None and not fut.done():
                why = "peer listener not taking messages" if isinstance(e, zmq.Again) else f"peer link: {e}"
                fut.set_exception(RequestError(ErrorCode.HANDSHAKE_FAILED, why))

        self.sock.send(encode(req), flags=zmq.NOBLOCK).add_done_callback(sent)
        return seq, fut

    async def answer(self, sent: tuple[int, asyncio.Future[LeaseState]], timeout_s: float) -> LeaseState:
        seq, fut = sent
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"no lease answer in {timeout_s}s") from None
        finally:
            self._waiting.pop(seq, None)

    async def run(self) -> None:
        """Hand each reply to its caller until closed."""
        try:
            while not self.closed:
                frames = await self.sock.recv_multipart()
                try:
                    reply = handshake_reply_decoder.decode(frames[0])
                except DECODE_ERRORS:
                    continue
                if isinstance(reply, LeaseState):
                    fut = self._waiting.get(reply.seq)
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
                elif isinstance(reply, Refused):  # unsigned/refused: fail every waiting call
                    for fut in self._waiting.values():
                        if not fut.done():
                            fut.set_exception(RequestError(reply.code, reply.reason))
        except (zmq.ZMQError, asyncio.CancelledError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(0)


RenewalSent = tuple[PeerLink, tuple[int, "asyncio.Future[LeaseState]"]]  # Peers.send_renewal


class Peers:
    """The peer sidecars: the dialer (handshakes, kept-open links, digests) and the listener
    (answers Hello, digest requests and lease renewals). ``peers`` by handshake endpoint."""

    def __init__(self, *, config: Config, dial_ctx: zmq.asyncio.Context, engine_id: str, agent_name: str,
                 registry: RankRegistry, nixl: NixlPort, observer: Observer, holds: Holds, secret: bytes,
                 generation: Callable[[], str],
                 spawn: Callable[[Any], None]) -> None:
        self.config = config
        self.dial_ctx = dial_ctx  # handshake dialing never shares the engine socket's I/O thread
        self.engine_id = engine_id
        self.agent_name = agent_name
        self.registry = registry
        self.nixl = nixl
        self.observer = observer
        self.holds = holds
        self.secret = secret  # empty: no handshake authentication
        self._generation = generation
        self._spawn = spawn
        self.challenges = ChallengeBook(agent_name)
        # CurveZMQ keys of every listener sharing the secret: the channel is encrypted
        self.curve = (curve_server_keys(secret)
                      if secret and config.handshake_encryption != "none" else None)
        # agents that completed an authenticated handshake here (newest last; bounded)
        self.authenticated: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.peers: dict[str, Peer] = {}
        self._handshakes: dict[str, asyncio.Future[Peer]] = {}
        self._links: dict[str, PeerLink] = {}

    @property
    def generation(self) -> str:
        return self._generation()

    def configure_listener(self, sock: zmq.asyncio.Socket) -> None:
        """Before bind: make the handshake listener a CurveZMQ server (with a secret)."""
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey = self.curve
            sock.curve_server = True

    def _dial(self, addr: str) -> zmq.asyncio.Socket:
        """A DEALER to a peer's handshake listener (a CurveZMQ client with a secret)."""
        sock = self.dial_ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.curve_serverkey = self.curve[0]
        sock.connect(addr)
        return sock

    def is_authenticated(self, agent: str) -> bool:
        """With a secret: did this agent complete an authenticated handshake here? (Always
        true without one: nobody is authenticated, anyone may.)"""
        return not self.secret or agent in self.authenticated

    def _authenticated(self, agent: str) -> None:
        self.authenticated[agent] = None
        self.authenticated.move_to_end(agent)
        while len(self.authenticated) > 4096:
            self.authenticated.popitem(last=False)

    def values(self) -> list[Peer]:
        return list(self.peers.values())

    def by_agent(self, agent: str) -> Peer | None:
        return next((p for p in self.peers.values() if p.agent_name == agent), None)

    # ---------------------------------------------------------------- dialer

    async def current_peer(self, host: str, port: int, generation: str = "") -> Peer:
        """The peer at host:port, handshaked again when the request names a registration
        generation the cached one does not have (the prefill sidecar restarted on the same
        endpoint, or its engine re-registered: its cached memory descriptions are stale)."""
        peer = await self.get_peer(host, port)
        if peer.outdated_by(generation):
            log.info("peer %s:%d is now generation %s (cached %s): handshaking again", host, port,
                     generation, peer.generation)
            peer.stale = True
            peer = await self.get_peer(host, port)
        return peer

    def cached_peer(self, host: str, port: int, generation: str = "") -> Peer | None:
        """The peer at host:port if it is handshaked, not stale and (when ``generation`` is
        given) of that generation: what ``current_peer`` returns without a handshake."""
        peer = self.peers.get(f"{host}:{port}")
        if peer is None or peer.stale or peer.outdated_by(generation):
            return None
        return peer

    async def get_peer(self, host: str, port: int) -> Peer:
        """The peer at host:port, handshaking once however many requests ask at once."""
        key = f"{host}:{port}"
        peer = self.peers.get(key)
        if peer is not None and not peer.stale:
            return peer
        fut = self._handshakes.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._handshake(host, port))
            self._handshakes[key] = fut
            fut.add_done_callback(lambda _f: self._handshakes.pop(key, None))
        return await asyncio.shield(fut)

    async def _handshake(self, host: str, port: int) -> Peer:
        key = f"{host}:{port}"
        local = self.registry.first_layout()
        start = time.monotonic()
        try:
            addr = await self._resolve(host, port)
        except RequestError as e:
            self.observer.handshake(key, False, time.monotonic() - start, e.reason)
            raise
        sock = self._dial(addr)
        timeout_s = self.config.handshake_timeout_s

        async def ask(msg: Hello) -> tuple[Any, list[bytes]]:
            await sock.send(encode(msg))
            if not await sock.poll(int(max(0.0, start + timeout_s - time.monotonic()) * 1000)):
                # CurveZMQ gives no answer at all to a mismatched peer: say what it may be
                why = ("it is down, or does not share our secret (the channel is encrypted with keys "
                       "derived from it)" if self.curve else
                       "it is down, or requires a shared secret (an encrypted channel)")
                raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                                   f"no handshake answer from {key} within {timeout_s}s: {why}")
            frames = await sock.recv_multipart()
            try:
                return handshake_reply_decoder.decode(frames[0]), frames
            except DECODE_ERRORS as e:
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"bad reply from {key}: {e}") from e

        try:
            hello = Hello(
                version=PROTOCOL_VERSION,
                compat_hash=compat_hash(local),
                engine_id=self.engine_id,
                agent_name=self.agent_name,
                model=local.model if local else "",
            )
            reply, frames = await ask(hello)
            if self.secret and isinstance(reply, Challenge):
                hello = sign_hello(self.secret, hello, reply.nonce, reply.agent_name)
                reply, frames = await ask(hello)
            if isinstance(reply, Refused):
                raise RequestError(reply.code, f"{key} refused the handshake: {reply.reason}")
            if not isinstance(reply, Welcome):
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key} answered a hello with {reply!r}")
            if reply.version != PROTOCOL_VERSION or reply.compat_hash != hello.compat_hash:
                raise RequestError(
                    ErrorCode.INCOMPATIBLE,
                    f"{key} runs protocol {reply.version} hash {reply.compat_hash}; "
                    f"we run {PROTOCOL_VERSION} hash {hello.compat_hash}",
                )
            if len(frames) != 2 or not reply.ranks:
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key}: welcome without metadata")
            if self.secret and not check_welcome(self.secret, reply, hello, frames[1]):
                raise RequestError(ErrorCode.UNAUTHORIZED, f"{key} cannot prove it holds the shared secret")
            for info in reply.ranks:
                validate_rank_info(info, reply.compat_hash)
            # an older sidecar names no engine per rank: they are all its own engine's
            infos = [msgspec.structs.replace(r, engine_id=r.engine_id or reply.engine_id)
                     for r in reply.ranks]
            if len({r.key for r in infos}) != len(infos):
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key} advertised a rank twice")
            cached = self.peers.get(key)
            if (cached is not None and cached.agent_name == reply.agent_name and reply.generation
                    and cached.generation == reply.generation and len(cached.ranks) == len(reply.ranks)):
                pass  # the same registrations: keep NIXL's state (reads in flight go on)
            else:
                reload = cached is not None and cached.agent_name == reply.agent_name
                await self.nixl.add_peer(reply.agent_name, frames[1], infos, reload)
        except RequestError as e:
            self.observer.handshake(key, False, time.monotonic() - start, e.reason)
            raise
        finally:
            sock.close(0)
        took = time.monotonic() - start
        peer = Peer(
            endpoint=key,
            engine_id=reply.engine_id,
            agent_name=reply.agent_name,
            ranks={r.key: r for r in infos},
            handshake_s=took,
            connected_unix=time.time(),
            generation=reply.generation,
        )
        old = self.peers.get(key)
        if old is not None and old.agent_name == peer.agent_name:
            peer.reads, peer.bytes, peer.failures = old.reads, old.bytes, old.failures
            peer.verified = old.verified
        self.peers[key] = peer
        self.observer.handshake(key, True, took)
        log.info("handshake with %s (%s) in %.1f ms", key, peer.engine_id, took * 1e3)
        return peer

    async def _resolve(self, host: str, port: int) -> str:
        """host -> a tcp:// address with an IP literal, resolved off the ZMQ I/O thread.

        ZMQ resolves names inside its I/O thread, so one unresolvable host would stall
        every socket of the context for the resolver's timeout.
        """
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                self.config.handshake_timeout_s,
            )
        except (OSError, UnicodeError, ValueError, TimeoutError) as e:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"cannot resolve {host!r}: {e}") from None
        if not infos:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"cannot resolve {host!r}")
        family, _, _, _, sockaddr = infos[0]
        ip = sockaddr[0]
        return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"

    async def call_peer(self, host: str, port: int, req: LeaseRenew, timeout_s: float) -> LeaseState:
        """A lease renewal at the peer's listener over one kept-open connection per endpoint;
        raises RequestError when it refuses or does not answer in time."""
        key = f"{host}:{port}"
        link = self._links.get(key)
        if link is None or link.closed:
            link = PeerLink(self._dial(await self._resolve(host, port)))
            self._links[key] = link
            self._spawn(link.run())
        return await link.call(req, timeout_s, self.secret)

    def send_renewal(self, host: str, port: int, req: LeaseRenew) -> RenewalSent | None:
        """Send a lease renewal now over the endpoint's open link (None: no link open yet);
        ``renewal_answer`` waits for its reply."""
        link = self._links.get(f"{host}:{port}")
        if link is None or link.closed:
            return None
        return link, link.send(req, self.secret)

    async def renewal_answer(self, sent: RenewalSent, timeout_s: float) -> LeaseState:
        link, pending = sent
        return await link.answer(pending, timeout_s)

    def close_links(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    async def drop_peer(self, agent: str, reason: str) -> bool:
        """Forget a peer (by agent name); its next request handshakes afresh."""
        dropped = False
        for key, peer in list(self.peers.items()):
            if peer.agent_name == agent:
                del self.peers[key]
                dropped = True
                self.observer.peer_dropped(key, reason)
                link = self._links.pop(key, None)
                if link is not None:
                    link.close()
        log.warning("dropped peer %s: %s", agent, reason)
        with contextlib.suppress(Exception):
            await self.nixl.remove_peer(agent, reason)
        return dropped

    # ---------------------------------------------------------------- listener

    async def serve(self, hs_sock: zmq.asyncio.Socket) -> None:
        """Answer every request on the handshake listener."""
        slots = asyncio.Semaphore(LISTENER_CONCURRENCY)

        async def answer(ident: bytes, request: HandshakeRequest | Exception, addr: str) -> None:
            try:
                reply, extra = await self._answer_hello(request, addr)
                with contextlib.suppress(zmq.ZMQError):
                    await hs_sock.send_multipart([ident, encode(reply), *extra])
            except Exception:
                log.exception("answering a peer failed")
            finally:
                slots.release()

        while True:
            frames = await hs_sock.recv_multipart(copy=False)
            request: HandshakeRequest | Exception
            try:
                request = handshake_request_decoder.decode(frames[-1].bytes)
            except DECODE_ERRORS as e:
                request = e  # (answered, and counted, as a bad hello)
            # A lease renewal (the claim of a read in progress: the read's Done waits for it)
            # is answered here and now; every other request on its own (at most
            # LISTENER_CONCURRENCY at once), so none queues behind a handshake or a digest
            # waiting on the NIXL thread.
            if isinstance(request, LeaseRenew):
                renewal = self._answer_renewal(request, frames[-1])
                with contextlib.suppress(zmq.ZMQError):
                    hs_sock.send_multipart([frames[0].bytes, encode(renewal)], flags=zmq.NOBLOCK)
                continue
            await slots.acquire()
            self._spawn(answer(frames[0].bytes, request, peer_address(frames[-1])))

    def _answer_renewal(self, msg: LeaseRenew, frame: zmq.Frame) -> LeaseState | Refused:
        """The answer to a ``LeaseRenew``, given in the listener's loop."""
        why = self._unsigned(msg)
        if why:
            addr, sender = peer_address(frame), msg.agent_name or "?"
            log.warning("handshake refused (from %s, %s): %s", addr or "?", sender, why)
            self.observer.handshake_refused(f"{addr} {sender}".strip(), ErrorCode.UNAUTHORIZED)
            return Refused(version=PROTOCOL_VERSION, code=ErrorCode.UNAUTHORIZED, reason=why)
        state = self._renew(msg)
        if "held" in state.held:
            self.nixl.expect_reads()  # (a claim: the read follows; see expect_reads)
        return state

    def _renew(self, msg: LeaseRenew) -> LeaseState:
        """Extend the leases; the answer names this sidecar's generation, so that a reader
        whose request named none still learns that its plan came from stale descriptions."""
        return msgspec.structs.replace(self.holds.renew(msg), generation=self.generation)

    def _unsigned(self, msg: DigestRequest | LeaseRenew) -> str:
        """Why a signed request is refused here ("": it is not)."""
        if not self.secret:
            return ""
        if not check_request(self.secret, msg):
            return f"{type(msg).__name__} without a valid signature"
        if not self.is_authenticated(msg.agent_name):
            return (f"{type(msg).__name__} from an agent that did not complete an authenticated "
                    "handshake here")
        return ""

    async def _answer_hello(
        self, request: HandshakeRequest | Exception, addr: str = ""
    ) -> tuple[Welcome | Refused | DigestReply | LeaseState | Challenge, list[bytes]]:
        """The answer to a handshake request, decoded once by the listener (an exception: it
        did not decode)."""
        sender = ""

        def refuse(code: ErrorCode, reason: str) -> tuple[Refused, list[bytes]]:
            log.warning("handshake refused (from %s%s): %s", addr or "?", f", {sender}" if sender else "",
                        reason)
            self.observer.handshake_refused(f"{addr} {sender}".strip(), code)
            return Refused(version=PROTOCOL_VERSION, code=code, reason=reason), []

        if isinstance(request, Exception):
            self.observer.bad_message("handshake")
            return refuse(ErrorCode.MALFORMED, f"bad hello: {request}")
        hello = request
        sender = f"{hello.agent_name or '?'}"
        if isinstance(hello, DigestRequest | LeaseRenew) and (why := self._unsigned(hello)):
            return refuse(ErrorCode.UNAUTHORIZED, why)
        if isinstance(hello, DigestRequest):
            try:
                return await self._answer_digest(hello), []
            except RequestError as e:
                return refuse(e.code, f"digest of {hello.req_id!r}: {e.reason}")
        if isinstance(hello, LeaseRenew):
            return self._renew(hello), []
        sender = f"{hello.agent_name!r} of engine {hello.engine_id!r}"
        if self.secret:
            if not hello.mac:  # step one: prove you hold the secret, answering this challenge
                return Challenge(version=PROTOCOL_VERSION, nonce=self.challenges.issue(),
                                 agent_name=self.agent_name), []
            why = self.challenges.check_hello(self.secret, hello)
            if why is not None:
                return refuse(ErrorCode.UNAUTHORIZED, why)
        if hello.version != PROTOCOL_VERSION:
            return refuse(
                ErrorCode.INCOMPATIBLE,
                f"protocol version {hello.version}, this sidecar speaks {PROTOCOL_VERSION}",
            )
        layout = self.registry.first_layout()
        if layout is None:
            return refuse(ErrorCode.NOT_REGISTERED, "no KV cache registered yet")
        ours = compat_hash(layout)
        if hello.compat_hash != ours:
            if hello.model != layout.model:
                return refuse(ErrorCode.INCOMPATIBLE, f"different models: the peer serves "
                              f"{hello.model or '(unnamed)'!r}, this engine {layout.model or '(unnamed)'!r}")
            return refuse(
                ErrorCode.INCOMPATIBLE,
                f"compatibility hash {hello.compat_hash} != {ours} (model layout differs: "
                f"{layout.model_signature()})",
            )
        metadata = await self.nixl.metadata()
        welcome = Welcome(
            version=PROTOCOL_VERSION,
            compat_hash=ours,
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            ranks=self.registry.infos(),
            generation=self.generation,
        )
        if self.secret:
            welcome = sign_welcome(self.secret, welcome, hello, metadata)
            self._authenticated(hello.agent_name)
        log.info("handshake from %s (%s) accepted: %d ranks offered", addr or "?", sender, len(welcome.ranks))
        self.observer.handshake_accepted(hello.agent_name, hello.engine_id)
        return welcome, [metadata]

    # ---------------------------------------------------------------- integrity digests

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

    async def request_digest(self, host: str, port: int, req: DigestRequest, timeout_s: float) -> list[str]:
        """Ask a peer's listener for the digests of ``req``; raises RequestError."""
        if self.secret:
            req = sign_request(self.secret, req)
        sock = self._dial(await self._resolve(host, port))
        try:
            await sock.send(encode(req))
            if not await sock.poll(int(timeout_s * 1000)):
                raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                                   f"no digest from {host}:{port} in {timeout_s}s")
            frames = await sock.recv_multipart()
        finally:
            sock.close(0)
        try:
            reply = handshake_reply_decoder.decode(frames[0])
        except DECODE_ERRORS as e:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"bad digest reply: {e}") from e
        if isinstance(reply, Refused):
            raise RequestError(reply.code, reply.reason)
        if not isinstance(reply, DigestReply) or len(reply.digests) != len(req.ranks):
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"unexpected digest reply {reply!r}")
        return reply.digests
