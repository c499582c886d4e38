"""The sidecar daemon: the asyncio front end over the NIXL thread.

It owns three things and nothing else: the engine socket (ZMQ ROUTER on ``ipc://``,
0600), the peer handshake listener (ZMQ ROUTER on TCP), and the timers (leases). Every
NIXL call goes through ``TransferEngine.call``; this loop never blocks on NIXL.

Request flow (pull model): the prefill engine ``Hold``s blocks under a lease; the decode
engine sends ``Recv`` naming the prefill sidecar's handshake endpoint; this side
handshakes once per peer, posts chunked NIXL READs, answers ``Done`` or ``Failed`` with
the exact local block ids, and sends the prefill sidecar a ``ReadNotice`` over NIXL,
which releases the lease there (``Released``) — or the lease expires.

No handler may raise out of the loop: malformed input gets an ``Error`` reply, a failed
request a ``Failed`` reply, and the sidecar keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvxfer import __version__
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.leases import Lease, LeaseTable
from kvxfer.memory import validate_registration
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Done,
    Error,
    Failed,
    Hello,
    Hold,
    Ping,
    Pong,
    RankInfo,
    ReadNotice,
    Recv,
    Refused,
    Registered,
    RegisterKV,
    Release,
    Released,
    Unregister,
    Welcome,
    compat_hash,
    encode,
    engine_request_decoder,
    handshake_reply_decoder,
    handshake_request_decoder,
    read_notice_decoder,
)
from kvxfer.topology import (
    BlockPairing,
    Incompatible,
    RankPlan,
    block_pairing,
    check_layout,
    plan_rank,
)
from kvxfer.transfer import NoticeReceived, ReadFinished, TransferEngine, TransferOptions

log = logging.getLogger(__name__)

_ENGINE_TAGS = {"register", "unregister", "hold", "release", "recv", "ping"}


@dataclass
class _Peer:
    endpoint: str
    engine_id: str
    agent_name: str
    ranks: dict[int, RankInfo]
    handshake_s: float


@dataclass
class _RecvState:
    owner: bytes  # where Done / Failed go
    msg: Recv
    peer_agent: str = ""


def recv_key(req_id: str, tp_rank: int) -> str:
    """One receive per (request, local rank): each rank reads its own memory."""
    return f"{tp_rank}:{req_id}"


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def classify_bad_message(body: bytes) -> ErrorCode:
    """UNKNOWN_MESSAGE for a well-formed message of an unknown kind, else MALFORMED."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return ErrorCode.MALFORMED
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] not in _ENGINE_TAGS:
        return ErrorCode.UNKNOWN_MESSAGE
    return ErrorCode.MALFORMED


class Sidecar:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine_id = config.resolved_engine_id
        self.agent_name = f"kvxfer-{self.engine_id}-{secrets.token_hex(4)}"
        self.started = time.monotonic()
        self.ctx = zmq.asyncio.Context()
        self.engine_sock: zmq.asyncio.Socket | None = None
        self.hs_sock: zmq.asyncio.Socket | None = None
        self.handshake_port = config.handshake_port
        self.ranks: dict[int, RankInfo] = {}
        self.rank_owner: dict[int, bytes] = {}
        self.leases = LeaseTable()
        self.recvs: dict[str, _RecvState] = {}
        self.peers: dict[str, _Peer] = {}  # by handshake endpoint "host:port"
        self._handshakes: dict[str, asyncio.Future[_Peer]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._lease_wakeup = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        opts = TransferOptions(
            ucx_error_mode=config.ucx_error_mode,
            num_threads=config.nixl_threads,
            chunk_bytes=config.chunk_mib << 20,
            max_inflight_chunks=config.max_inflight_chunks,
            idle_poll_s=config.idle_poll_ms / 1000.0,
            cuda=config.cuda_enabled,
        )
        self.transfer = TransferEngine(self.agent_name, opts, self._from_nixl_thread)
        self.stats = {"handshakes": 0, "handshake_failures": 0, "stray_notices": 0,
                      "bad_messages": 0, "recv_ok": 0, "recv_failed": 0}

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await asyncio.wrap_future(self.transfer.start())
        self._bind()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self.loop.add_signal_handler(sig, self._stop.set)
        print(
            f"kvxfer {__version__} ready: engine_id={self.engine_id} "
            f"engine_socket={self.config.engine_socket} "
            f"handshake={self.config.resolved_advertise_host}:{self.handshake_port} "
            f"agent={self.agent_name} ucx_error_mode={self.config.ucx_error_mode}",
            file=sys.stderr,
            flush=True,
        )
        loops = [
            asyncio.ensure_future(self._engine_loop()),
            asyncio.ensure_future(self._handshake_loop()),
            asyncio.ensure_future(self._lease_loop()),
        ]
        try:
            await self._stop.wait()
        finally:
            for t in loops + list(self._tasks):
                t.cancel()
            await asyncio.gather(*loops, *self._tasks, return_exceptions=True)
            await asyncio.to_thread(self.transfer.stop)
            self._close()

    def request_stop(self) -> None:
        self._stop.set()

    def _bind(self) -> None:
        self.engine_sock = self.ctx.socket(zmq.ROUTER)
        self.engine_sock.setsockopt(zmq.LINGER, 0)
        self.engine_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reclaims its id
        path = ipc_path(self.config.engine_socket)
        if path:
            directory = os.path.dirname(path) or "."
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700)
            old = os.umask(0o177)
            try:
                self.engine_sock.bind(self.config.engine_socket)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
        else:
            self.engine_sock.bind(self.config.engine_socket)
        self.hs_sock = self.ctx.socket(zmq.ROUTER)
        self.hs_sock.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://{self.config.handshake_host}"
        if self.config.handshake_port == 0:
            self.handshake_port = self.hs_sock.bind_to_random_port(addr)
        else:
            self.hs_sock.bind(f"{addr}:{self.config.handshake_port}")

    def _close(self) -> None:
        for sock in (self.engine_sock, self.hs_sock):
            if sock is not None:
                sock.close(0)
        self.ctx.term()
        path = ipc_path(self.config.engine_socket)
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _nixl(self, fn: Any, *args: Any) -> Any:
        return await asyncio.wrap_future(self.transfer.call(fn, *args))

    # ------------------------------------------------------------------ engine socket

    def _send(self, ident: bytes, msg: Any) -> None:
        assert self.engine_sock is not None
        try:
            self.engine_sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("engine connection %r is not reading; dropped %s", ident, type(msg).__name__)

    def _fail(self, ident: bytes, req_id: str, block_ids: list[int], err: RequestError) -> None:
        log.warning("request %s failed: [%s] %s", req_id, err.code, err.reason)
        self.stats["recv_failed"] += 1
        self._send(ident, Failed(req_id=req_id, block_ids=block_ids, code=err.code, reason=err.reason))

    async def _engine_loop(self) -> None:
        assert self.engine_sock is not None
        while True:
            frames = await self.engine_sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            if len(frames) != 2:
                self.stats["bad_messages"] += 1
                self._send(ident, Error(code=ErrorCode.MALFORMED, message="expected one frame"))
                continue
            try:
                msg = engine_request_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.stats["bad_messages"] += 1
                code = classify_bad_message(body)
                log.warning("bad engine message (%s): %s", code, e)
                self._send(ident, Error(code=code, message=str(e)))
                continue
            try:
                await self._dispatch(ident, msg)
            except RequestError as e:
                self._send(ident, Error(code=e.code, message=e.reason, req_id=e.req_id))
            except Exception as e:
                log.exception("internal error handling %s", type(msg).__name__)
                self._send(ident, Error(code=ErrorCode.INTERNAL, message=repr(e)))

    async def _dispatch(self, ident: bytes, msg: Any) -> None:
        match msg:
            case Ping(seq=seq):
                self._send(ident, self._pong(seq))
            case Hold():
                self._on_hold(ident, msg)
            case Recv():
                self._on_recv(ident, msg)
            case Release(req_id=req_id):
                lease = self.leases.pop(req_id)
                if lease is None:
                    raise RequestError(ErrorCode.UNKNOWN_REQUEST, "not held", req_id)
                self._release(lease, "aborted")
            case RegisterKV():
                self._spawn(self._on_register(ident, msg))
            case Unregister(tp_rank=rank):
                await self._nixl(self.transfer.t_unregister, rank)
                self.ranks.pop(rank, None)
                self.rank_owner.pop(rank, None)

    def _pong(self, seq: int) -> Pong:
        return Pong(
            seq=seq,
            engine_id=self.engine_id,
            version=PROTOCOL_VERSION,
            handshake_host=self.config.resolved_advertise_host,
            handshake_port=self.handshake_port,
        )

    async def _on_register(self, ident: bytes, msg: RegisterKV) -> None:
        try:
            validate_registration(msg)
            lay = msg.layout
            try:
                check_layout(lay)
            except Incompatible as e:
                raise RequestError(ErrorCode.INVALID_LAYOUT, str(e)) from None
            for other in self.ranks.values():
                if other.layout.tp_rank == lay.tp_rank:
                    continue
                if other.layout.tp_size != lay.tp_size:
                    raise RequestError(ErrorCode.INVALID_LAYOUT, "tp_size differs between ranks")
                if other.layout.model_signature() != lay.model_signature():
                    raise RequestError(ErrorCode.INVALID_LAYOUT, "model layout differs between ranks")
            info: RankInfo = await self._nixl(self.transfer.t_register, msg)
        except RequestError as e:
            self._send(ident, Error(code=e.code, message=e.reason))
            return
        except Exception as e:
            log.exception("registration failed")
            self._send(ident, Error(code=ErrorCode.MEMORY_MAP_FAILED, message=repr(e)))
            return
        self.ranks[lay.tp_rank] = info
        self.rank_owner[lay.tp_rank] = ident
        nbytes = sum(m.size for m in msg.memory)
        log.info("registered tp_rank %d: %d bytes", lay.tp_rank, nbytes)
        self._send(
            ident,
            Registered(
                tp_rank=lay.tp_rank,
                engine_id=self.engine_id,
                agent_name=self.agent_name,
                bytes_registered=nbytes,
                handshake_host=self.config.resolved_advertise_host,
                handshake_port=self.handshake_port,
            ),
        )

    def _check_blocks(self, req_id: str, block_ids: list[int], num_blocks: int, side: str) -> None:
        bad = [b for b in block_ids if b >= num_blocks]
        if bad:
            raise RequestError(
                ErrorCode.BLOCK_OUT_OF_RANGE,
                f"{side} block ids {bad[:8]} outside [0, {num_blocks})",
                req_id,
            )

    def _on_hold(self, ident: bytes, msg: Hold) -> None:
        if not self.ranks:
            raise RequestError(ErrorCode.NOT_REGISTERED, "no KV cache registered", msg.req_id)
        num_blocks = min(r.layout.num_blocks for r in self.ranks.values())
        self._check_blocks(msg.req_id, msg.block_ids, num_blocks, "held")
        now = time.monotonic()
        self.leases.add(
            Lease(
                req_id=msg.req_id,
                owner=ident,
                block_ids=list(msg.block_ids),
                expires=now + (msg.lease_s or self.config.lease_s),
                reads_expected=msg.reads,
                created=now,
                notify_ranks=msg.notify_ranks,
            )
        )
        self._lease_wakeup.set()

    def _on_recv(self, ident: bytes, msg: Recv) -> None:
        key = recv_key(msg.req_id, msg.tp_rank)
        if key in self.recvs:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "receive already in flight", msg.req_id)
        if msg.reply_to_rank:
            ident = self.rank_owner.get(msg.tp_rank, ident)
        try:
            local = self.ranks.get(msg.tp_rank)
            if local is None:
                raise RequestError(ErrorCode.NOT_REGISTERED, f"tp_rank {msg.tp_rank} not registered")
            self._check_blocks(msg.req_id, msg.block_ids, local.layout.num_blocks, "local")
        except RequestError as e:
            self._fail(ident, msg.req_id, list(msg.block_ids), e)
            return
        self.recvs[key] = _RecvState(owner=ident, msg=msg)
        self._spawn(self._run_recv(key, msg))

    async def _run_recv(self, key: str, msg: Recv) -> None:
        start = time.monotonic()
        deadline_s = msg.deadline_s or self.config.transfer_timeout_s
        state = self.recvs[key]
        try:
            peer = await asyncio.wait_for(
                self._get_peer(msg.remote_host, msg.remote_port), timeout=deadline_s
            )
            plans, pairing = self._plan(msg, peer)
            state.peer_agent = peer.agent_name
            if not msg.block_ids:
                # Nothing to read (full prefix hit / abort): just release the prefill side.
                self.recvs.pop(key, None)
                self._send(state.owner, Done(req_id=msg.req_id, nbytes=0, seconds=0.0))
                await self._notify_peer(peer.agent_name, self._notice(msg, ok=True))
                return
            remaining = deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                raise RequestError(ErrorCode.DEADLINE, "deadline passed during handshake")
            await self._nixl(
                self.transfer.t_read,
                key,
                peer.agent_name,
                msg.tp_rank,
                list(msg.block_ids),
                list(msg.remote_block_ids),
                plans,
                pairing,
                remaining,
            )
        except TimeoutError:
            self._finish_recv_error(
                key, RequestError(ErrorCode.HANDSHAKE_FAILED, f"no handshake within {deadline_s}s")
            )
        except RequestError as e:
            self._finish_recv_error(key, e)
        except Exception as e:
            log.exception("receive %s failed", msg.req_id)
            self._finish_recv_error(key, RequestError(ErrorCode.TRANSFER_ERROR, repr(e)))

    def _plan(self, msg: Recv, peer: _Peer) -> tuple[list[RankPlan], BlockPairing]:
        """Which remote ranks to read, and how blocks pair up (kvxfer.topology)."""
        if msg.remote_engine_id and msg.remote_engine_id != peer.engine_id:
            raise RequestError(
                ErrorCode.UNKNOWN_PEER,
                f"{peer.endpoint} serves engine {peer.engine_id!r}, not {msg.remote_engine_id!r}",
            )
        local = self.ranks[msg.tp_rank].layout
        remote = next(iter(peer.ranks.values())).layout
        if msg.remote_tp_size != remote.tp_size:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"request says remote tp_size {msg.remote_tp_size}, peer has {remote.tp_size}",
            )
        try:
            plans = plan_rank(local, remote)
            pairing = block_pairing(local, remote)
            if msg.block_ids:
                pairing.pairs(len(msg.block_ids), len(msg.remote_block_ids))
        except Incompatible as e:
            raise RequestError(ErrorCode.INCOMPATIBLE, str(e)) from None
        for plan in plans:
            info = peer.ranks.get(plan.remote_rank)
            if info is None:
                raise RequestError(
                    ErrorCode.NOT_REGISTERED,
                    f"peer has {len(peer.ranks)} of {remote.tp_size} ranks registered; "
                    f"rank {plan.remote_rank} is missing",
                )
            self._check_blocks(msg.req_id, msg.remote_block_ids, info.layout.num_blocks, "remote")
        return plans, pairing

    def _finish_recv_error(self, key: str, err: RequestError) -> None:
        state = self.recvs.pop(key, None)
        if state is not None:
            self._fail(state.owner, state.msg.req_id, list(state.msg.block_ids), err)

    def _notice(self, msg: Recv, ok: bool) -> ReadNotice:
        readers = self.ranks[msg.tp_rank].layout.tp_size if msg.tp_rank in self.ranks else 0
        return ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=ok,
                          readers=readers)

    # ------------------------------------------------------------------ NIXL events

    def _from_nixl_thread(self, event: ReadFinished | NoticeReceived) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._on_nixl_event, event)

    def _on_nixl_event(self, event: ReadFinished | NoticeReceived) -> None:
        if isinstance(event, NoticeReceived):
            self._on_notice(event)
            return
        state = self.recvs.pop(event.req_id, None)
        if state is None:
            return
        msg = state.msg
        notice = self._notice(msg, event.ok)
        if event.ok:
            self.stats["recv_ok"] += 1
            self._send(state.owner, Done(req_id=msg.req_id, nbytes=event.nbytes, seconds=event.seconds,
                                         descriptors=event.descriptors))
        else:
            self._fail(state.owner, msg.req_id, list(msg.block_ids),
                       RequestError(event.code, event.reason, msg.req_id))
        if event.code == ErrorCode.PEER_DISCONNECTED:
            self._spawn(self._drop_peer(event.peer, event.reason))
        else:
            self._spawn(self._notify_peer(event.peer, notice))

    async def _notify_peer(self, agent: str, notice: ReadNotice) -> None:
        try:
            await self._nixl(self.transfer.t_send_notice, agent, encode(notice))
        except Exception as e:
            log.warning("read notice for %s to %s not sent: %s", notice.req_id, agent, e)

    def _on_notice(self, event: NoticeReceived) -> None:
        try:
            notice = read_notice_decoder.decode(event.payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats["stray_notices"] += 1
            return
        lease = self.leases.note_read(notice.req_id, notice.tp_rank, notice.readers)
        if lease is None:
            if notice.req_id not in self.leases:
                self.stats["stray_notices"] += 1
            return
        self._release(lease, "read" if notice.ok else "aborted")

    def _release(self, lease: Lease, reason: str) -> None:
        """Tell the engine it may reuse the blocks: the holder, or every worker."""
        ev = Released(req_id=lease.req_id, reason=reason, reads=lease.reads_seen)  # type: ignore[arg-type]
        targets = set(self.rank_owner.values()) if lease.notify_ranks else {lease.owner}
        for ident in targets or {lease.owner}:
            self._send(ident, ev)

    async def _lease_loop(self) -> None:
        while True:
            nxt = self.leases.next_expiry()
            timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
            self._lease_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lease_wakeup.wait(), timeout)
            for lease in self.leases.expire(time.monotonic()):
                log.warning("lease on request %s expired after %.1fs with %d/%d reads",
                            lease.req_id, time.monotonic() - lease.created,
                            lease.reads_seen, lease.reads_expected)
                self._release(lease, "expired")

    # ------------------------------------------------------------------ peers / handshake

    async def _get_peer(self, host: str, port: int) -> _Peer:
        key = f"{host}:{port}"
        peer = self.peers.get(key)
        if peer is not None:
            return peer
        fut = self._handshakes.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._handshake(host, port))
            self._handshakes[key] = fut
            fut.add_done_callback(lambda _f: self._handshakes.pop(key, None))
        return await asyncio.shield(fut)

    async def _handshake(self, host: str, port: int) -> _Peer:
        key = f"{host}:{port}"
        local = next(iter(self.ranks.values()), None)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        start = time.monotonic()
        try:
            sock.connect(f"tcp://{key}")
            hello = Hello(
                version=PROTOCOL_VERSION,
                compat_hash=compat_hash(local.layout if local else None),
                engine_id=self.engine_id,
                agent_name=self.agent_name,
            )
            await sock.send(encode(hello))
            timeout_ms = int(self.config.handshake_timeout_s * 1000)
            if not await sock.poll(timeout_ms):
                raise RequestError(
                    ErrorCode.HANDSHAKE_FAILED,
                    f"no handshake answer from {key} within {self.config.handshake_timeout_s}s",
                )
            frames = await sock.recv_multipart()
            try:
                reply = handshake_reply_decoder.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"bad reply from {key}: {e}") from e
            if isinstance(reply, Refused):
                raise RequestError(reply.code, f"{key} refused the handshake: {reply.reason}")
            if reply.version != PROTOCOL_VERSION or reply.compat_hash != hello.compat_hash:
                raise RequestError(
                    ErrorCode.INCOMPATIBLE,
                    f"{key} runs protocol {reply.version} hash {reply.compat_hash}; "
                    f"we run {PROTOCOL_VERSION} hash {hello.compat_hash}",
                )
            if len(frames) != 2 or not reply.ranks:
                raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"{key}: welcome without metadata")
            await self._nixl(self.transfer.t_add_peer, reply.agent_name, frames[1], reply.ranks)
        except RequestError:
            self.stats["handshake_failures"] += 1
            raise
        finally:
            sock.close(0)
        peer = _Peer(
            endpoint=key,
            engine_id=reply.engine_id,
            agent_name=reply.agent_name,
            ranks={r.layout.tp_rank: r for r in reply.ranks},
            handshake_s=time.monotonic() - start,
        )
        self.peers[key] = peer
        self.stats["handshakes"] += 1
        log.info("handshake with %s (%s) in %.1f ms", key, peer.engine_id, peer.handshake_s * 1e3)
        return peer

    async def _drop_peer(self, agent: str, reason: str) -> None:
        for key, peer in list(self.peers.items()):
            if peer.agent_name == agent:
                del self.peers[key]
        log.warning("dropped peer %s: %s", agent, reason)
        with contextlib.suppress(Exception):
            await self._nixl(self.transfer.t_remove_peer, agent, reason)

    async def _handshake_loop(self) -> None:
        assert self.hs_sock is not None
        while True:
            frames = await self.hs_sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            reply, extra = await self._answer_hello(body)
            self.hs_sock.send_multipart([ident, encode(reply), *extra])

    async def _answer_hello(self, body: bytes) -> tuple[Welcome | Refused, list[bytes]]:
        def refuse(code: ErrorCode, reason: str) -> tuple[Refused, list[bytes]]:
            log.warning("handshake refused: %s", reason)
            return Refused(version=PROTOCOL_VERSION, code=code, reason=reason), []

        try:
            hello = handshake_request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.stats["bad_messages"] += 1
            return refuse(ErrorCode.MALFORMED, f"bad hello: {e}")
        if hello.version != PROTOCOL_VERSION:
            return refuse(
                ErrorCode.INCOMPATIBLE,
                f"protocol version {hello.version}, this sidecar speaks {PROTOCOL_VERSION}",
            )
        if not self.ranks:
            return refuse(ErrorCode.NOT_REGISTERED, "no KV cache registered yet")
        ours = compat_hash(next(iter(self.ranks.values())).layout)
        if hello.compat_hash != ours:
            return refuse(
                ErrorCode.INCOMPATIBLE,
                f"compatibility hash {hello.compat_hash} != {ours} (model layout differs: "
                f"{next(iter(self.ranks.values())).layout.model_signature()})",
            )
        metadata: bytes = await self._nixl(self.transfer.t_metadata)
        welcome = Welcome(
            version=PROTOCOL_VERSION,
            compat_hash=ours,
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            ranks=[self.ranks[r] for r in sorted(self.ranks)],
        )
        return welcome, [metadata]


def run_server(config: Config) -> None:
    import uvloop

    logging.basicConfig(
        level=os.environ.get("KVXFER_LOG_LEVEL", config.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvloop.run(Sidecar(config).serve())
