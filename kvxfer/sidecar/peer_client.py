"""The dialing side of the peer conversation: handshakes with prefill sidecars (once per
endpoint, shared by concurrent requests), one kept-open link per endpoint for lease
renewals (claims, keep-alives), and digest requests.

It owns the conversation's outgoing half: what it learns goes into the ``PeerBook`` and,
for a new or changed peer, into the NIXL port (``add_peer``). It never calls back into its
callers; they await its answers.

With a shared secret (``kvxfer.auth``) the hello is challenge-bound and the welcome checked
for the secret's MAC, every request is signed, and the channel is a CurveZMQ client of the
listener's secret-derived key (the NIXL metadata it carries is never in clear).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvxfer import hostkey
from kvxfer.auth import check_welcome, curve_server_keys, sign_hello, sign_request
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    Challenge,
    DigestReply,
    DigestRequest,
    Hello,
    LeaseRenew,
    LeaseState,
    RankInfo,
    Refused,
    Welcome,
    compat_hash,
    compat_tp_hash,
    encode,
    handshake_reply_decoder,
    hashes_match,
)
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_link import LinkRequest, PeerLink, RenewalSent, resolve
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.sidecar.validate import validate_rank_info
from kvxfer.targets import is_loopback

log = logging.getLogger("kvxfer.peers")
MAX_REPLY = 64 << 20  # a peer's largest reply frame (a Welcome's NIXL metadata: a few MiB at most)


@dataclass(frozen=True)
class PeerChannel:
    """Who this sidecar is to its peers, and how their channel is secured."""

    engine_id: str
    agent_name: str
    secret: bytes = b""  # empty: no handshake authentication
    curve: tuple[bytes, bytes] | None = None  # the listeners' CurveZMQ key pair (from the secret)
    local_only: bool = False  # the secret is this host's key (kvxfer.hostkey): loopback peers only

    @classmethod
    def for_config(cls, config: Config, engine_id: str, agent_name: str) -> PeerChannel:
        """The shared secret; else, on loopback, this host's key, which only this user can read
        (another uid on the host reaches loopback as easily as we do); with --insecure nothing.
        CURVE keys derive from either: the dialer then knows it talks to a holder of the key,
        so a relay put in between (another local user's port named in a request's
        kv_transfer_params) sees only ciphertext, never the NIXL metadata. ConfigError when
        the listener would bind beyond loopback with nothing (short of --insecure), or the key
        cannot be had."""
        secret = config.load_secret()
        config.require_secret(secret)
        host_key = not secret and config.handshake_is_local and not config.insecure
        if host_key:
            secret = hostkey.load(config.resolved_host_key_file)
        encrypt = secret and config.handshake_encryption != "none"
        return cls(engine_id, agent_name, secret, curve_server_keys(secret) if encrypt else None,
                   local_only=host_key)

    def toward(self, addr: str) -> PeerChannel:
        """How a channel to ``addr`` (tcp://<IP literal>:<port>) is secured. A host key is
        only ever used with loopback peers: one beyond cannot hold it, and is dialed as a
        sidecar without a secret always dialed (it must then run --insecure)."""
        if not self.local_only or is_loopback(addr.removeprefix("tcp://")):
            return self
        return replace(self, secret=b"", curve=None)


def dial(ctx: zmq.asyncio.Context, addr: str, ch: PeerChannel) -> zmq.asyncio.Socket:
    """A DEALER to a peer's handshake listener (a CurveZMQ client with a secret)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)  # (a hostile peer's reply is dropped, not buffered)
    if ch.curve is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = ch.curve[0]
    sock.connect(addr)
    return sock


async def send_within(sock: zmq.asyncio.Socket, data: bytes, timeout_s: float, what: str) -> None:
    """``sock.send`` bounded by the time the exchange has (RequestError ``handshake_failed``
    after it): a DEALER with no connection to queue on waits for one, and nothing else bounds
    that wait (the reply's ``poll`` comes after it). A plain send has never been seen to block
    here, but a test's plain DEALER to a CURVE listener did, twice, under load."""
    try:
        await asyncio.wait_for(sock.send(data), max(0.001, timeout_s))
    except TimeoutError:
        raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{what}: not sent within {max(0.0, timeout_s):.1f}s "
                           "(no connection to queue it on)") from None


class PeerClient:
    def __init__(self, *, config: Config, channel: PeerChannel, dial_ctx: zmq.asyncio.Context,
                 book: PeerBook, registry: RankRegistry, nixl: NixlPort, observer: Observer) -> None:
        self.config = config
        self.channel = channel
        self.dial_ctx = dial_ctx  # handshake dialing never shares the engine socket's I/O thread
        self.book = book
        self.registry = registry
        self.nixl = nixl
        self.observer = observer
        self._handshakes: dict[str, asyncio.Future[Peer]] = {}
        self._links: dict[str, PeerLink] = {}
        self._link_tasks: set[asyncio.Task[None]] = set()
        self._socks: weakref.WeakSet[zmq.asyncio.Socket] = weakref.WeakSet()  # every socket dialed
        self._stalled: set[str] = set()  # endpoints dropped as stalled and not handshaked since
        self._drops: dict[str, int] = {}  # endpoint -> how often dropped as stalled

    # ---------------------------------------------------------------- peers

    def cached_peer(self, host: str, port: int, generation: str = "") -> Peer | None:
        """The peer at host:port if it is handshaked, not stale and (when ``generation`` is
        given) of that generation: what ``current_peer`` returns without a handshake."""
        return self.book.usable(f"{host}:{port}", generation)

    async def current_peer(self, host: str, port: int, generation: str = "") -> Peer:
        """The peer at host:port, handshaked again when the request names a registration
        generation the cached one does not have (the prefill sidecar restarted on the same
        endpoint, or its engine re-registered: its cached memory descriptions are stale)."""
        peer = await self.get_peer(host, port)
        if peer.outdated_by(generation):
            log.info("peer %s:%d: the request names generation %s, the cached peer has %s: handshaking "
                     "again", host, port, generation, peer.generation)
            self.book.mark_stale(peer)
            peer = await self.get_peer(host, port)
        return peer

    async def get_peer(self, host: str, port: int) -> Peer:
        """The peer at host:port, handshaking once however many requests ask at once."""
        key = f"{host}:{port}"
        peer = self.book.usable(key)
        if peer is not None:
            return peer
        fut = self._handshakes.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._handshake(host, port))
            self._handshakes[key] = fut
            fut.add_done_callback(lambda _f: self._handshakes.pop(key, None))
        return await asyncio.shield(fut)

    async def drop_peer(self, agent: str, reason: str) -> bool:
        """Forget a peer (by agent name); its next request handshakes afresh."""
        gone = self.book.drop(agent)
        for key in gone:
            self.observer.peer_dropped(key, reason)
            link = self._links.pop(key, None)
            if link is not None:  # (what waits on it fails now: its answers can no longer come)
                link.close(RequestError(ErrorCode.PEER_DISCONNECTED, f"peer dropped: {reason}"))
        log.warning("dropped peer %s: %s", agent, reason)
        try:
            await self.nixl.remove_peer(agent, reason)
        except Exception as e:
            log.debug("remove_peer(%s): %s", agent, e)
        return bool(gone)

    # ---------------------------------------------------------------- stalls (kvxfer.sidecar.liveness)

    def stalled_links(self, now: float) -> list[tuple[str, float]]:
        """(endpoint, seconds silent) of every link whose peer owes an answer and said
        nothing for --peer-stall-s."""
        return [(key, link.liveness.silent_s(now)) for key, link in self._links.items()
                if not link.closed and link.liveness.stalled(now)
                and not link.sock.get(zmq.EVENTS) & zmq.POLLIN]  # (replies not read yet: our loop lagged)

    def link_keys(self) -> list[str]:
        return list(self._links)

    def probe_due(self, key: str, now: float, after_s: float = 0.0) -> bool:
        """Whether to ask a peer for a sign of life now (``Liveness.probe_due``; no link: yes)."""
        link = self._links.get(key)
        return link is None or link.closed or link.liveness.probe_due(now, after_s)

    async def probe(self, host: str, port: int, engine_id: str) -> None:
        """A renewal of no lease: its answer is the sign of life (no answer: see stalled_links)."""
        with contextlib.suppress(RequestError):
            await self.call_peer(host, port, LeaseRenew(seq=0, engine_id=engine_id, req_ids=[],
                                                        agent_name=self.channel.agent_name),
                                 2 * self.config.peer_stall_s)

    async def drop_stalled(self, key: str, silent_s: float, idle: bool = False) -> None:
        """A stalled peer: the calls waiting on its link fail ``peer_stalled`` now, its reads are
        stopped and settled at once (``NixlPort.remove_peer``), and it is handshaked again,
        with --peer-stall-s for an answer, before its next use. ``idle``: no read ran against
        it (an idle probe went unanswered: it is gone, not stalled)."""
        link = self._links.get(key)
        if link is None or not link.liveness.stalled(time.monotonic()):
            return  # (it answered while other peers were dropped)
        reason = (f"peer {key} owed an answer and said nothing for {silent_s:.1f}s (--peer-stall-s "
                  f"{self.config.peer_stall_s:g}): " + ("gone; let go" if idle else
                                                       "stalled; its reads are stopped"))
        self._stalled.add(key)
        self._drops[key] = self._drops.get(key, 0) + 1  # (a handshake in flight must not put it back)
        del self._links[key]
        link.close(RequestError(ErrorCode.PEER_STALLED, reason))
        if idle:
            log.info("%s", reason)
            self.observer.peer_dropped(key, reason)
        else:
            self.observer.peer_stalled(key, reason)
        peer = self.book.get(key)
        if peer is None:
            return
        self.book.drop(peer.agent_name)
        try:
            await self.nixl.remove_peer(peer.agent_name, reason, stalled=True)
        except Exception as e:
            log.warning("remove_peer(%s): %s", peer.agent_name, e)

    # ---------------------------------------------------------------- the handshake

    async def _handshake(self, host: str, port: int) -> Peer:
        key = f"{host}:{port}"
        start = time.monotonic()
        drops = self._drops.get(key, 0)
        try:
            addr = await self._resolve(host, port)
            ch = self.channel.toward(addr)
            sock = self._dial(addr, ch)
            try:
                reply, metadata, infos = await self._hello(sock, key, start, ch)
            finally:
                sock.close(0)
            if reply.agent_name == self.channel.agent_name:  # (NIXL refuses to load its own agent)
                raise RequestError(ErrorCode.INCOMPATIBLE, f"{key} is this sidecar's own handshake listener")
            cached = self.book.get(key)
            if not (cached is not None and cached.agent_name == reply.agent_name and reply.generation
                    and cached.generation == reply.generation and len(cached.ranks) == len(reply.ranks)):
                # (the same registrations: NIXL's state stays, reads in flight go on)
                reload = cached is not None and cached.agent_name == reply.agent_name
                await self.nixl.add_peer(reply.agent_name, metadata, infos, reload, reply.lease_words_addr)
            if self._drops.get(key, 0) != drops:  # dropped as stalled meanwhile: its entry is gone again
                raise RequestError(ErrorCode.PEER_STALLED, f"{key} was found stalled during the handshake")
        except RequestError as e:
            self.observer.handshake(key, False, time.monotonic() - start, e.reason)
            raise
        except Exception as e:  # (NIXL's own errors, loading the peer: typed, and counted)
            self.observer.handshake(key, False, time.monotonic() - start, repr(e))
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key}: {e!r}") from e
        took = time.monotonic() - start
        peer = Peer(endpoint=key, engine_id=reply.engine_id, agent_name=reply.agent_name,
                    ranks={r.key: r for r in infos}, handshake_s=took, connected_unix=time.time(),
                    generation=reply.generation, staging_bytes=reply.staging_bytes,
                    lease_words=(reply.lease_words_addr, reply.lease_words_slots),
                    layer_streams=reply.layer_streams, grouped_streams=reply.grouped_streams,
                    chunk_streams=reply.chunk_streams, reader_engines=reply.reader_engines)
        self.book.put(peer)
        self._stalled.discard(key)
        self.observer.handshake(key, True, took)
        log.info("handshake with %s (%s) in %.1f ms", key, peer.engine_id, took * 1e3)
        if cached is not None and cached.agent_name != peer.agent_name and self.book.by_agent(
                cached.agent_name) is None:  # (another process took the endpoint: a restart)
            with contextlib.suppress(Exception):  # (its NIXL entry goes once its reads settled)
                await self.nixl.remove_peer(cached.agent_name, f"{key} is served by {peer.agent_name} now")
        return peer

    async def _hello(self, sock: zmq.asyncio.Socket, key: str, start: float,
                     ch: PeerChannel) -> tuple[Welcome, bytes, list[RankInfo]]:
        """Hello (answering a challenge with a secret) until a checked Welcome: the welcome,
        the NIXL metadata it carried, and the ranks it advertised."""
        local = self.registry.first_layout()
        hello = Hello(PROTOCOL_VERSION, compat_hash(local), ch.engine_id, ch.agent_name,
                      model=local.model if local else "", compat_tp=compat_tp_hash(local))
        reply, frames = await self._ask(sock, hello, key, start, ch)
        if ch.secret and isinstance(reply, Challenge):
            hello = sign_hello(ch.secret, hello, reply.nonce, reply.agent_name)
            reply, frames = await self._ask(sock, hello, key, start, ch)
        if isinstance(reply, Refused):
            raise RequestError(reply.code, f"{key} refused the handshake: {reply.reason}")
        if not isinstance(reply, Welcome):
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key} answered a hello with {reply!r}")
        if reply.version != PROTOCOL_VERSION or not hashes_match(hello.compat_hash, hello.compat_tp,
                                                                 reply.compat_hash, reply.compat_tp):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{key} runs protocol {reply.version} hash "
                               f"{reply.compat_hash}; we run {PROTOCOL_VERSION} hash {hello.compat_hash}")
        if len(frames) != 2 or not reply.ranks:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key}: welcome without metadata")
        if ch.secret and not reply.mac:
            raise RequestError(ErrorCode.UNAUTHORIZED, f"{key} runs without authentication (--insecure): "
                               "this sidecar requires the shared secret or, on loopback, the host key; "
                               "give both the same secret (or both --insecure)")
        if ch.secret and not check_welcome(ch.secret, reply, hello, frames[1]):
            raise RequestError(ErrorCode.UNAUTHORIZED, f"{key} cannot prove it holds the shared secret "
                               "(or, both on loopback without one, this host's key)")
        for info in reply.ranks:
            validate_rank_info(info, reply.compat_hash, (hello.compat_hash, hello.compat_tp))
        # an older sidecar names no engine per rank: they are all its own engine's
        infos = [msgspec.structs.replace(r, engine_id=r.engine_id or reply.engine_id) for r in reply.ranks]
        if len({r.key for r in infos}) != len(infos):
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key} advertised a rank twice")
        return reply, frames[1], infos

    async def _ask(self, sock: zmq.asyncio.Socket, msg: Hello, key: str, start: float,
                   ch: PeerChannel) -> tuple[Any, list[bytes]]:
        timeout_s = self.config.handshake_timeout_s
        if key in self._stalled and self.config.peer_stall_s:  # (it stalled: fail its requests fast)
            timeout_s = min(timeout_s, self.config.peer_stall_s)
        await send_within(sock, encode(msg), start + timeout_s - time.monotonic(), f"hello to {key}")
        if not await sock.poll(int(max(0.0, start + timeout_s - time.monotonic()) * 1000)):
            # CurveZMQ gives no answer at all to a mismatched peer: say what it may be
            what = ("this host's key (what a sidecar with no shared secret uses on loopback)"
                    if ch.local_only else "our secret")
            why = (f"it is down, or does not hold {what}: the channel is encrypted with keys derived "
                   "from it, and a peer with another secret or on --insecure answers none" if ch.curve else
                   "it is down, or requires a shared secret (an encrypted channel)")
            raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                               f"no handshake answer from {key} within {timeout_s}s: {why}")
        frames = await sock.recv_multipart()
        try:
            return handshake_reply_decoder.decode(frames[0]), frames
        except DECODE_ERRORS as e:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"bad reply from {key}: {e}") from e

    # ---------------------------------------------------------------- requests

    async def call_peer(self, host: str, port: int, req: LinkRequest, timeout_s: float) -> Any:
        """A lease renewal (``LeaseState``) or a stage request (``Staged``) at the peer's
        listener over one kept-open connection per endpoint; raises RequestError when it
        refuses or does not answer in time."""
        key = f"{host}:{port}"
        link = self._links.get(key)
        if link is None or link.closed:
            addr = await self._resolve(host, port)
            link = self._links.get(key)  # (another call may have opened one meanwhile: one link each)
        if link is None or link.closed:
            ch = self.channel.toward(addr)
            link = PeerLink(self._dial(addr, ch), ch.secret, self.config.peer_stall_s)
            self._links[key] = link
            task = asyncio.ensure_future(link.run())
            self._link_tasks.add(task)
            task.add_done_callback(self._link_tasks.discard)
        return await link.call(req, timeout_s)

    def send_renewal(self, host: str, port: int, req: LeaseRenew) -> RenewalSent | None:
        """Send a lease renewal now over the endpoint's open link (None: no link open yet);
        ``renewal_answer`` waits for its reply."""
        link = self._links.get(f"{host}:{port}")
        if link is None or link.closed:
            return None
        return link, link.send(req)

    async def renewal_answer(self, sent: RenewalSent, timeout_s: float) -> LeaseState:
        link, pending = sent
        return await link.answer(pending, timeout_s)

    async def request_digest(self, host: str, port: int, req: DigestRequest, timeout_s: float) -> list[str]:
        """Ask a peer's listener for the digests of ``req``; raises RequestError."""
        addr = await self._resolve(host, port)
        ch = self.channel.toward(addr)
        if ch.secret:
            req = sign_request(ch.secret, req)
        sock = self._dial(addr, ch)
        try:
            start = time.monotonic()
            await send_within(sock, encode(req), timeout_s, f"digest request to {host}:{port}")
            if not await sock.poll(int(max(0.0, start + timeout_s - time.monotonic()) * 1000)):
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

    def close(self) -> None:
        """Close every socket this client dialed (links, handshakes and digest requests still
        in flight): a ZMQ context cannot terminate while one of its sockets is open."""
        for link in self._links.values():
            link.close()
        self._links.clear()
        for task in self._link_tasks:
            task.cancel()
        for sock in list(self._socks):
            if not sock.closed:
                sock.close(0)

    # ---------------------------------------------------------------- sockets

    def _dial(self, addr: str, ch: PeerChannel) -> zmq.asyncio.Socket:
        sock = dial(self.dial_ctx, addr, ch)
        self._socks.add(sock)  # (closed at close, if still open)
        return sock

    async def _resolve(self, host: str, port: int) -> str:
        return await resolve(host, port, self.config.handshake_timeout_s)
