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
from kvxfer.auth import ReplayGuard
from kvxfer.config import Config
from kvxfer.control.access import load_policy
from kvxfer.errors import ConfigError, ErrorCode, RequestError
from kvxfer.integrity import digest_items
from kvxfer.leases import Lease, LeaseTable
from kvxfer.memory import validate_registration
from kvxfer.observe import Event, Observer, start_metrics_server
from kvxfer.peers import Peer, PeersMixin
from kvxfer.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    DigestRank,
    DigestRequest,
    Done,
    Error,
    Failed,
    Hold,
    KeepAlive,
    KVLayout,
    LeaseRenew,
    LeaseState,
    Ping,
    Pong,
    ReadNotice,
    Recv,
    Registered,
    RegisterKV,
    Release,
    Released,
    Unregister,
    encode,
    engine_request_decoder,
    read_notice_decoder,
)
from kvxfer.registry import RankEntry, RankKey, RankRegistry
from kvxfer.systemd import Notifier
from kvxfer.topology import (
    BlockPairing,
    Incompatible,
    RankPlan,
    block_pairing,
    check_layout,
    plan_stages,
)
from kvxfer.transfer import NoticeReceived, ReadFinished, ReadStuck, TransferEngine, TransferOptions

log = logging.getLogger(__name__)
EXIT_STUCK = 3  # a failed read's chunks could not be stopped: restart to fence them off

_ENGINE_TAGS = {"register", "unregister", "hold", "release", "recv", "ping"}
MAX_MESSAGE = 16 << 20  # larger engine messages get a typed error (a million block ids is ~5 MiB)
HARD_MAX_MESSAGE = 64 << 20  # ZMQ drops the connection of a peer that sends more


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
    claim: asyncio.Future[str] | None = None  # the prefill's "still held": "" yes, else why not

    @property
    def peer(self) -> str:
        return f"{self.msg.remote_host}:{self.msg.remote_port}"


def recv_key(req_id: str, tp_rank: int, engine: str = "", pp_rank: int = 0) -> str:
    """One receive per (request, local rank): each rank reads its own memory."""
    return f"{engine}/{pp_rank}/{tp_rank}:{req_id}"


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def classify_bad_message(body: bytes) -> ErrorCode:
    """UNKNOWN_MESSAGE for a well-formed message of an unknown kind, else MALFORMED."""
    try:
        raw = msgspec.msgpack.decode(body)
    except DECODE_ERRORS:
        return ErrorCode.MALFORMED
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] not in _ENGINE_TAGS:
        return ErrorCode.UNKNOWN_MESSAGE
    return ErrorCode.MALFORMED


class Sidecar(PeersMixin):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine_id = config.resolved_engine_id
        self.agent_name = f"kvxfer-{self.engine_id}-{secrets.token_hex(4)}"
        self.started = time.monotonic()
        self.ctx = zmq.asyncio.Context()
        self.dial_ctx = zmq.asyncio.Context()
        self.engine_sock: zmq.asyncio.Socket | None = None
        self.hs_sock: zmq.asyncio.Socket | None = None
        self.handshake_port = config.handshake_port
        self.leases = LeaseTable()
        self.recvs: dict[str, _RecvState] = {}
        self.peers: dict[str, Peer] = {}  # by handshake endpoint "host:port"
        self._handshakes: dict[str, asyncio.Future[Peer]] = {}
        self._receives_done = 0  # successful reads so far (1 in verify_sample is checked)
        self._links: dict[str, Any] = {}  # kept-open connections to peers' listeners (peers.PeerLink)
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
            active_poll_s=config.active_poll_ms / 1000.0,
            settle_timeout_s=config.settle_timeout_s,
            cuda=config.cuda_enabled,
        )
        self.transfer = TransferEngine(self.agent_name, opts, self._from_nixl_thread)
        self.registry = RankRegistry(self.engine_id, self._nixl, self.transfer.t_register,
                                     self.transfer.t_unregister)
        self.observer = Observer()
        self.systemd = Notifier()
        self.secret = config.load_secret()
        self.control_policy = load_policy(config)
        self.replay_guard = ReplayGuard()
        self.draining = False
        self.ready = False
        self._idle = asyncio.Event()  # nothing in flight, nothing held
        self.exit_code = 0
        self.on_drain: Any = None  # async callback (the control server flips readiness)

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await asyncio.wrap_future(self.transfer.start())
        self._bind()
        self.ready = True
        self.observer.g_ready.set(1)
        control: list[Any] = []
        if self.config.control_target or self.config.health_target:
            from kvxfer.control.service import start_control_server

            control = await start_control_server(self, self.config.control_target, self.control_policy,
                                                 self.config.health_target)
        if self.config.metrics_port:
            start_metrics_server(self.observer, self.config.metrics_host, self.config.metrics_port)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.loop.add_signal_handler(signal.SIGINT, self._stop.set)  # operator: stop now
            self.loop.add_signal_handler(signal.SIGTERM, self._graceful_stop)  # orchestrator
        print(
            f"kvxfer {__version__} ready: engine_id={self.engine_id} "
            f"engine_socket={self.config.engine_socket} "
            f"handshake={self.config.resolved_advertise_host}:{self.handshake_port} "
            f"agent={self.agent_name} ucx_error_mode={self.config.ucx_error_mode} "
            f"control={self.config.control_target or '-'} metrics_port={self.config.metrics_port or '-'}",
            file=sys.stderr,
            flush=True,
        )
        loops = [
            asyncio.ensure_future(self._engine_loop()),
            asyncio.ensure_future(self._handshake_loop()),
            asyncio.ensure_future(self._lease_loop()),
            asyncio.ensure_future(self._engine_watch_loop()),
        ]
        if self.systemd.enabled:
            loops.append(asyncio.ensure_future(self._systemd_loop()))
        for task in loops:
            task.add_done_callback(self._loop_died)
        self.systemd.ready(self._status_line())
        try:
            await self._stop.wait()
        finally:
            self.systemd.stopping("stopping")
            for t in loops + list(self._tasks):
                t.cancel()
            await asyncio.gather(*loops, *self._tasks, return_exceptions=True)
            await asyncio.gather(*(c.stop(0.5) for c in control))
            await asyncio.to_thread(self.transfer.stop)
            self._close()

    def request_stop(self) -> None:
        self._stop.set()

    def _loop_died(self, task: asyncio.Task[Any]) -> None:
        """A serving loop must never end while running: log why and stop (the supervisor restarts)."""
        if task.cancelled() or self._stop.is_set():
            return
        log.critical("serving loop %s died: %r; stopping", task, task.exception(),
                     exc_info=task.exception())
        self.exit_code = 1
        self._stop.set()

    def _graceful_stop(self) -> None:
        """SIGTERM: readiness off, drain within drain_timeout_s, then stop."""

        self.systemd.stopping("draining")

        async def run() -> None:
            drained, failed, released, took = await self.drain(self.config.drain_timeout_s)
            log.warning("drained in %.2fs (failed %d receives, released %d holds); stopping",
                        took, failed, released)
            self._stop.set()

        self._spawn(run())

    def _bind(self) -> None:
        self.engine_sock = self.ctx.socket(zmq.ROUTER)
        self.engine_sock.setsockopt(zmq.LINGER, 0)
        self.engine_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reclaims its id
        self.engine_sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE)
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
        self.hs_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a Hello is a few hundred bytes
        addr = f"tcp://{self.config.handshake_host}"
        if self.config.handshake_port == 0:
            self.handshake_port = self.hs_sock.bind_to_random_port(addr)
        else:
            self.hs_sock.bind(f"{addr}:{self.config.handshake_port}")

    def _close(self) -> None:
        self.close_links()
        for sock in (self.engine_sock, self.hs_sock):
            if sock is not None:
                sock.close(0)
        self.ctx.term()
        self.dial_ctx.term()
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
        self._send(ident, Failed(req_id=req_id, block_ids=block_ids, code=err.code, reason=err.reason))

    async def _engine_loop(self) -> None:
        assert self.engine_sock is not None
        while True:
            frames = await self.engine_sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            if len(frames) != 2:
                self.observer.bad_message("engine")
                self._send(ident, Error(code=ErrorCode.MALFORMED, message="expected one frame"))
                continue
            if len(body) > MAX_MESSAGE:
                self.observer.bad_message("engine")
                why = f"message of {len(body)} bytes is too large (max {MAX_MESSAGE})"
                self._send(ident, Error(code=ErrorCode.MALFORMED, message=why))
                continue
            try:
                msg = engine_request_decoder.decode(body)
            except DECODE_ERRORS as e:
                self.observer.bad_message("engine")
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
                lease = self.leases.pop((self.registry.engine_of(msg.engine_id), req_id))
                if lease is None:
                    raise RequestError(ErrorCode.UNKNOWN_REQUEST, "not held", req_id)
                self._release(lease, "aborted")
            case RegisterKV():
                self._spawn(self._on_register(ident, msg))
            case KeepAlive():
                self._spawn(self._keepalive(ident, msg))
            case Unregister(tp_rank=rank):
                entry = self.registry.find(msg.engine_id, msg.pp_rank, rank)
                if entry is None or entry.owner != ident:
                    raise RequestError(ErrorCode.NOT_REGISTERED, f"rank pp{msg.pp_rank}/tp{rank} of engine "
                                       f"{self.registry.engine_of(msg.engine_id)!r} is not registered by "
                                       "this connection")
                await self.registry.remove(entry.key)

    def _pong(self, seq: int) -> Pong:
        return Pong(
            seq=seq,
            engine_id=self.engine_id,
            version=PROTOCOL_VERSION,
            handshake_host=self.config.resolved_advertise_host,
            handshake_port=self.handshake_port,
            instance=self.agent_name,
            generation=self.generation,
        )

    @property
    def generation(self) -> str:
        """Changes when this sidecar restarts (new agent) or a registration is replaced or
        removed (its memory may be gone): held blocks are only valid in their generation.
        A rank registered for the first time does not change it."""
        return f"{self.agent_name}/{self.registry.changes}"

    async def _on_register(self, ident: bytes, msg: RegisterKV) -> None:
        """Register a rank (``RankRegistry``: a failed re-registration unregisters the key,
        whose old memory is already gone, and moves the generation)."""
        try:
            validate_registration(msg)
            try:
                check_layout(msg.layout)
            except Incompatible as e:
                raise RequestError(ErrorCode.INVALID_LAYOUT, str(e)) from None
            entry, _replaced = await self.registry.register(msg, ident)
        except Exception as e:
            if not isinstance(e, RequestError):
                log.exception("registration failed")
                e = RequestError(ErrorCode.MEMORY_MAP_FAILED, repr(e))
            log.warning("registration of %s refused: [%s] %s", self.registry.key_of(msg), e.code, e.reason)
            self._send(ident, Error(code=e.code, message=e.reason))
            return
        nbytes = sum(m.size for m in msg.memory)
        log.info("registered %s: %d bytes", entry.key, nbytes)
        self._send(
            ident,
            Registered(
                tp_rank=entry.key.tp,
                engine_id=entry.key.engine,
                agent_name=self.agent_name,
                bytes_registered=nbytes,
                handshake_host=self.config.resolved_advertise_host,
                handshake_port=self.handshake_port,
                pp_rank=entry.key.pp,
                dp_rank=entry.key.dp,
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
        if self.draining:
            raise RequestError(ErrorCode.DRAINING, "sidecar is draining; no new holds", msg.req_id)
        engine = self.registry.engine_of(msg.engine_id)
        ranks = self.registry.of_engine(engine)
        if not ranks:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"engine {engine!r} has no KV cache registered "
                               f"(registered: {self.registry.engines()})", msg.req_id)
        num_blocks = min(r.layout.num_blocks for r in ranks)
        self._check_blocks(msg.req_id, msg.block_ids, num_blocks, "held")
        if msg.expires_unix and time.time() > msg.expires_unix:
            raise RequestError(ErrorCode.EXPIRED, "hold arrived after the engine freed its blocks "
                               f"({time.time() - msg.expires_unix:.1f}s late)", msg.req_id)
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
                engine=engine,
                duration=msg.lease_s or self.config.lease_s,
            )
        )
        self._gauges()
        self._lease_wakeup.set()

    def _on_recv(self, ident: bytes, msg: Recv) -> None:
        engine = self.registry.engine_of(msg.engine_id)
        key = recv_key(msg.req_id, msg.tp_rank, engine, msg.pp_rank)
        if key in self.recvs:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "receive already in flight", msg.req_id)
        local = self.registry.find(engine, msg.pp_rank, msg.tp_rank)
        if msg.reply_to_rank and local is not None:
            ident = local.owner
        try:
            if self.draining:
                raise RequestError(ErrorCode.DRAINING, "sidecar is draining; no new receives")
            if local is None:
                raise RequestError(ErrorCode.NOT_REGISTERED,
                                   f"rank pp{msg.pp_rank}/tp{msg.tp_rank} of engine {engine!r} not "
                                   f"registered (registered: {self.registry.describe()})")
            self._check_blocks(msg.req_id, msg.block_ids, local.layout.num_blocks, "local")
            if msg.expires_unix and time.time() > msg.expires_unix:
                raise RequestError(ErrorCode.EXPIRED, "receive arrived after the engine gave up on it "
                                   f"({time.time() - msg.expires_unix:.1f}s late); not read")
        except RequestError as e:
            self._fail(ident, msg.req_id, list(msg.block_ids), e)
            return
        now = time.monotonic()
        block_bytes = sum(r.block_len for r in local.info.regions)
        if msg.expires_unix:  # never read past the moment the engine gives up on the load
            left = max(0.001, msg.expires_unix - time.time())
            msg = msgspec.structs.replace(msg, deadline_s=min(msg.deadline_s or left, left))
        self.recvs[key] = _RecvState(
            owner=ident, msg=msg, nbytes=block_bytes * len(msg.block_ids), started=now,
            deadline=now + (msg.deadline_s or self.config.transfer_timeout_s), local=local.key,
        )
        self._gauges()
        self._spawn(self._run_recv(key, msg))

    async def _run_recv(self, key: str, msg: Recv) -> None:
        start = time.monotonic()
        deadline_s = msg.deadline_s or self.config.transfer_timeout_s
        state = self.recvs[key]
        try:
            peer = await asyncio.wait_for(
                self.current_peer(msg.remote_host, msg.remote_port, msg.remote_generation),
                timeout=deadline_s,
            )
            if self.recvs.get(key) is not state:
                return  # cancelled or failed while the handshake ran
            self._check_generation(msg, peer)
            try:
                plans, pairing = self._plan(msg, peer, state)
            except RequestError as e:
                if e.code != ErrorCode.NOT_REGISTERED:
                    raise
                peer.stale = True  # handshaked while some ranks were missing: ask again once
                peer = await asyncio.wait_for(self.get_peer(msg.remote_host, msg.remote_port),
                                              timeout=deadline_s)
                if self.recvs.get(key) is not state:
                    return  # cancelled (and reported) while it handshaked again: never read
                self._check_generation(msg, peer)
                plans, pairing = self._plan(msg, peer, state)
            state.peer_agent = peer.agent_name
            if not msg.block_ids:
                # Nothing to read (full prefix hit / abort): just release the prefill side.
                self.recvs.pop(key, None)
                self._gauges()
                self._send(state.owner, Done(req_id=msg.req_id, nbytes=0, seconds=0.0))
                await self._notify_peer(peer.agent_name, self._notice(state, ok=True))
                return
            remaining = deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                raise RequestError(ErrorCode.DEADLINE, "deadline passed during handshake")
            state.state = "reading"
            # The claim: the prefill confirms it still holds the blocks and extends the lease
            # over the whole read, in parallel with it; Done waits for the answer, and a lease
            # that was already over fails the load (the blocks may hold another request's KV).
            state.claim = asyncio.ensure_future(self._claim(msg, state, remaining))
            # The prefill side must not let its lease run out under a read in progress: the
            # NIXL thread tells it once the first chunk is posted (it must not delay the read).
            started = ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=True,
                                 reading_s=remaining, engine_id=state.remote_engine, pp_rank=msg.pp_rank)
            await self._nixl(
                self.transfer.t_read,
                key,
                peer.agent_name,
                state.local,
                list(msg.block_ids),
                list(msg.remote_block_ids),
                plans,
                pairing,
                remaining,
                encode(started),
                state.remote_engine,
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

    def _check_generation(self, msg: Recv, peer: Peer) -> None:
        if msg.remote_generation and peer.generation and peer.generation != msg.remote_generation:
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
            plans = plan_stages(local, stages)
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
            self._check_blocks(msg.req_id, msg.remote_block_ids, info.layout.num_blocks, "remote")
        return plans, pairing

    def _finish_recv_error(self, key: str, err: RequestError) -> None:
        state = self.recvs.pop(key, None)
        if state is not None:
            self.observer.transfer_failed(
                state.msg.req_id, state.peer, state.msg.tp_rank, err.code, err.reason
            )
            self._fail(state.owner, state.msg.req_id, list(state.msg.block_ids), err)
            self._gauges()

    def _gauges(self) -> None:
        o = self.observer
        o.g_inflight.set(len(self.recvs))
        o.g_inflight_bytes.set(sum(r.nbytes for r in self.recvs.values()))
        o.g_leases.set(len(self.leases))
        o.g_peers.set(len(self.peers))
        self.transfer.set_serving(bool(self.leases))
        if self.recvs or self.leases:
            self._idle.clear()
        else:
            self._idle.set()

    def _notice(self, state: _RecvState, ok: bool) -> ReadNotice:
        """The read notice for the prefill: every (pp, tp) rank of this engine reads once."""
        msg = state.msg
        entry = self.registry.get(state.local) if state.local is not None else None
        readers = entry.layout.tp_size * entry.layout.pp_size if entry is not None else 0
        return ReadNotice(req_id=msg.remote_req_id or msg.req_id, tp_rank=msg.tp_rank, ok=ok,
                          readers=readers, engine_id=state.remote_engine, pp_rank=msg.pp_rank)

    # ------------------------------------------------------------------ NIXL events

    def _from_nixl_thread(self, event: ReadFinished | NoticeReceived | ReadStuck) -> None:
        assert self.loop is not None
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self._on_nixl_event, event)

    def _on_nixl_event(self, event: ReadFinished | NoticeReceived | ReadStuck) -> None:
        if isinstance(event, NoticeReceived):
            self._on_notice(event)
            return
        if isinstance(event, ReadStuck):
            # NIXL cannot stop this read's chunks, and reporting it failed would let the
            # engine reuse blocks they may still write: exit, so the endpoints die with us
            # (the supervisor restarts the sidecar; connectors see it and fail their loads).
            # No graceful teardown: it waits on the NIXL thread, the frozen peer's endpoints and
            # open handshake sockets, and every second of it is a second a late write can land.
            log.critical("read %s from %s still has chunks in flight %.1fs after it failed; exiting "
                         "so that no late write can land in reused blocks", event.req_id, event.peer,
                         event.seconds)
            self.exit_code = EXIT_STUCK
            hard_exit(EXIT_STUCK)
            return
        state = self.recvs.get(event.req_id)
        if state is None:
            return
        peer = next((p for p in self.peers.values() if p.agent_name == event.peer), None)
        try:
            self._read_finished(state, event, peer)
        except Exception as e:  # a bug must fail this receive, never leave it waiting forever
            log.exception("finishing receive %s", event.req_id)
            self._finish(state, event, peer, RequestError(ErrorCode.INTERNAL, repr(e), state.msg.req_id))

    def _read_finished(self, state: _RecvState, event: ReadFinished, peer: Peer | None) -> None:
        """A read landed: once the prefill confirmed its lease (the claim), verify a sample,
        then report."""
        claim = state.claim
        if event.ok and claim is not None:
            if not claim.done():
                state.state = "verifying"  # still in flight: drain waits for it, cancel fails it
                self._spawn(self._after_claim(state, event, peer))
                return
            why = claim.result() if not claim.exception() else f"claim failed: {claim.exception()!r}"
            if why:
                self._finish(state, event, peer, RequestError(ErrorCode.EXPIRED, why, state.msg.req_id))
                return
        if event.ok and peer is not None and self._sample(peer):
            state.state = "verifying"
            self._spawn(self._verify(state, event, peer))
            return
        self._finish(state, event, peer)

    async def _after_claim(self, state: _RecvState, event: ReadFinished, peer: Peer | None) -> None:
        assert state.claim is not None
        await asyncio.wait([state.claim])
        if self.recvs.get(event.req_id) is state:  # not cancelled meanwhile
            self._read_finished(state, event, peer)

    async def _claim(self, msg: Recv, state: _RecvState, reading_s: float) -> str:
        """Ask the prefill whether it still holds the blocks, extending the lease over the read
        and its verification. "" when held; else why the read must not be trusted."""
        timeout = self.config.handshake_timeout_s
        renew = LeaseRenew(seq=0, engine_id=state.remote_engine, req_ids=[msg.remote_req_id or msg.req_id],
                           extend_s=reading_s + timeout + 1.0, agent_name=self.agent_name)
        end = time.monotonic() + timeout
        pause = 0.002
        while True:
            try:
                got = await self.call_peer(msg.remote_host, msg.remote_port, renew,
                                           max(0.05, end - time.monotonic()))
            except RequestError as e:
                return f"the prefill did not confirm it still holds the blocks: {e.reason}"
            except Exception as e:  # never leave a read waiting on a claim that raised
                log.exception("claim of %s failed", msg.req_id)
                return f"the prefill did not confirm it still holds the blocks: {e!r}"
            answer = got.held[0] if got.held else "unknown"
            if answer == "held":
                return ""
            if answer == "gone":
                break
            # Not held *yet*: its Hold may still be on the way to the prefill sidecar (the
            # engine keeps the blocks meanwhile). Ask again, briefly.
            if time.monotonic() + pause > end:
                return "the prefill sidecar does not hold this request (its Hold never arrived)"
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        self.observer.emit(Event("lease_expired_before_read", request_id=msg.req_id, peer=state.peer))
        return ("the prefill's lease on these blocks was over before the read: they may already hold "
                "another request's KV; not used")

    async def _keepalive(self, ident: bytes, msg: KeepAlive) -> None:
        """Renew the prefill leases of requests still waiting here (handshaking first: the
        read that follows then starts warm); tell the engine which leases are gone."""
        if len(msg.req_ids) != len(msg.remote_req_ids):
            self._send(ident, Error(code=ErrorCode.MALFORMED, message="keepalive: req_ids and "
                                    "remote_req_ids differ in length"))
            return
        timeout = self.config.handshake_timeout_s
        try:
            peer = await asyncio.wait_for(self.get_peer(msg.remote_host, msg.remote_port), 2 * timeout)
            engine = peer.resolve_engine(msg.remote_engine_id)
            renew = LeaseRenew(seq=0, engine_id=engine, req_ids=list(msg.remote_req_ids),
                               agent_name=self.agent_name)
            got = await self.call_peer(msg.remote_host, msg.remote_port, renew, timeout)
        except (RequestError, TimeoutError) as e:
            log.info("keep-alive of %d leases at %s:%d not delivered: %s", len(msg.req_ids), msg.remote_host,
                     msg.remote_port, e)
            return
        for local, held in zip(msg.req_ids, got.held, strict=False):
            if held == "gone":
                self._send(ident, Error(code=ErrorCode.EXPIRED, req_id=local,
                                        message="the prefill's lease on this request's blocks is over"))

    def renew_leases(self, req: LeaseRenew) -> LeaseState:
        """A peer still means to read these requests: extend their leases (by ``extend_s``,
        or each lease's own duration); say which are no longer held."""
        now = time.monotonic()
        held: list[Any] = []
        for rid in req.req_ids:
            key = self.leases.resolve(req.engine_id, rid)
            lease = self.leases.get(key) if key is not None else None
            if key is None or lease is None:
                gone = self.leases.ended(req.engine_id, rid)
                if gone:
                    self.observer.stray_notice(req.agent_name, rid, "expired_lease")
                held.append("gone" if gone else "unknown")
                continue
            self.leases.extend(key, now + (req.extend_s or lease.duration or self.config.lease_s))
            held.append("held")
        self._lease_wakeup.set()
        return LeaseState(seq=req.seq, held=held)

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
            self._send(state.owner, Done(req_id=msg.req_id, nbytes=event.nbytes, seconds=event.seconds,
                                         descriptors=event.descriptors))
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
            self._fail(state.owner, msg.req_id, list(msg.block_ids), err)
        self._gauges()
        if event.code == ErrorCode.PEER_DISCONNECTED:
            self._spawn(self.drop_peer(event.peer, event.reason))
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
            items = digest_items(plans, pairing, list(msg.block_ids), list(msg.remote_block_ids))
            ranks = sorted(items)
            req = DigestRequest(
                req_id=msg.remote_req_id or msg.req_id, agent_name=self.agent_name,
                engine_id=state.remote_engine,
                ranks=[DigestRank(rank=tp, items=items[(pp, tp)][1], pp_rank=pp,
                                  region0=items[(pp, tp)][2].remote_region0,
                                  num_regions=items[(pp, tp)][2].num_regions) for pp, tp in ranks])
            timeout = self.config.handshake_timeout_s
            remote, local = await asyncio.gather(
                self.request_digest(msg.remote_host, msg.remote_port, req, timeout),
                asyncio.gather(*(self._nixl(self.transfer.t_digest, state.local, items[r][0],
                                            items[r][2].local_region0, items[r][2].num_regions)
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
            await self._nixl(self.transfer.t_send_notice, agent, encode(notice))
        except Exception as e:
            log.warning("read notice for %s to %s not sent: %s", notice.req_id, agent, e)

    def _on_notice(self, event: NoticeReceived) -> None:
        try:
            notice = read_notice_decoder.decode(event.payload)
        except DECODE_ERRORS:
            self.observer.stray_notice(event.agent, "", "malformed")
            return
        key = self.leases.resolve(notice.engine_id, notice.req_id)
        if notice.reading_s > 0:
            if key is not None and self.leases.extend(key, time.monotonic() + notice.reading_s + 1.0):
                self._lease_wakeup.set()
            else:
                self.observer.stray_notice(event.agent, notice.req_id, "expired_lease")
            return
        if key is None:
            self.observer.stray_notice(event.agent, notice.req_id, "unknown")
            return
        lease = self.leases.note_read(key, (notice.pp_rank, notice.tp_rank), notice.readers)
        if lease is None:
            return
        self._release(lease, "read" if notice.ok else "aborted")

    def _release(self, lease: Lease, reason: str) -> None:
        """Tell the engine it may reuse the blocks: the holder, or every worker."""
        ev = Released(req_id=lease.req_id, reason=reason, reads=lease.reads_seen)  # type: ignore[arg-type]
        self.observer.lease_released(lease.req_id, reason)
        self._gauges()
        targets = self.registry.owners(lease.engine) if lease.notify_ranks else {lease.owner}
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


    # ------------------------------------------------------------------ systemd

    def _status_line(self) -> str:
        t = self.observer.totals
        state = "draining" if self.draining else "serving"
        return (f"{state}: {len(self.registry)} ranks, {len(self.peers)} peers, {len(self.leases)} held, "
                f"{len(self.recvs)} in flight, {t.transfers_ok} transfers, {t.transfers_failed} failed")

    async def _systemd_loop(self) -> None:
        """Watchdog pings (only while the loop itself runs) and a STATUS= line."""
        period = self.systemd.watchdog_s or 5.0
        while True:
            await asyncio.sleep(period)
            if self.systemd.watchdog_s:
                self.systemd.watchdog()
            self.systemd.status(self._status_line())

    # ------------------------------------------------------------------ engine death

    async def _engine_watch_loop(self) -> None:
        """Notice engine processes that died: drop their memory, leases and receives."""
        while True:
            await asyncio.sleep(self.config.engine_check_s)
            for entry in self.registry.dead():
                await self._engine_gone(entry, f"engine process {entry.pid} exited")

    async def _engine_gone(self, entry: RankEntry, reason: str) -> None:
        log.warning("%s: %s; dropping its registration, receives and holds", entry.key, reason)
        for key, st in list(self.recvs.items()):
            if st.local == entry.key:
                if st.state == "reading":
                    await self._nixl(self.transfer.t_cancel, key, ErrorCode.NOT_REGISTERED, reason)
                else:
                    self._finish_recv_error(key, RequestError(ErrorCode.NOT_REGISTERED, reason))
        await self.registry.remove(entry.key, unlink=True)  # the dead engine cannot remove its files
        engine = entry.key.engine
        # the whole engine gone: nobody will free or read its holds; else those of that worker
        gone = (self.leases.drop(engine=engine) if not self.registry.of_engine(engine)
                else self.leases.drop(owner=entry.owner))
        for lease in gone:
            self.observer.lease_released(lease.req_id, "aborted")
        self.observer.emit(Event("engine_gone", reason=f"{entry.key}: {reason}", tp_rank=entry.key.tp))
        self._gauges()

    # ------------------------------------------------------------------ control operations

    async def connect_peer(self, host: str, port: int) -> Peer:
        """Pre-warm: handshake now so the first request does not pay for it."""
        if not self.registry:
            raise RequestError(ErrorCode.NOT_REGISTERED,
                               "register the engine's KV cache first: the handshake carries its layout")
        peer = await self.get_peer(host, port)
        self._gauges()
        return peer

    async def disconnect_peer(self, which: str) -> bool:
        """Forget a peer by endpoint (host:port) or engine id."""
        agents = {p.agent_name for k, p in self.peers.items() if which in (k, p.engine_id)}
        dropped = False
        for agent in agents:
            dropped |= await self.drop_peer(agent, "disconnected by operator")
        self._gauges()
        return dropped

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED,
                     reason: str = "cancelled by operator") -> int:
        """Fail every rank's receive of a request now; returns how many were cancelled."""
        keys = [k for k, st in self.recvs.items() if st.msg.req_id == req_id or not req_id]
        for key in keys:
            state = self.recvs.get(key)
            if state is None:
                continue
            if state.state == "reading" and await self._nixl(self.transfer.t_cancel, key, code, reason):
                continue  # the NIXL thread reports the failure through the usual path
            self._finish_recv_error(key, RequestError(code, reason, req_id))
        return len(keys)

    async def drain(self, timeout_s: float) -> tuple[bool, int, int, float]:
        """Refuse new holds/receives; wait for in-flight work; fail/release what is left."""
        start = time.monotonic()
        if not self.draining:
            self.draining = True
            self.observer.g_ready.set(0)
            self.observer.emit(Event("drain_started"))
            if self.on_drain is not None:
                await self.on_drain()
        self._gauges()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        failed = len(self.recvs)
        if failed:
            await self.cancel("", ErrorCode.DRAINING, "sidecar drained before the transfer finished")
        released = 0
        for lease in self.leases.drain_all():
            self._release(lease, "aborted")
            released += 1
        took = time.monotonic() - start
        self.observer.emit(Event("drained", seconds=took))
        return failed == 0 and released == 0, failed, released, took


def hard_exit(code: int) -> None:
    """Flush the log and leave now: no teardown, no atexit, no waiting on any thread."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_server(config: Config) -> int:
    """Run the daemon until SIGINT, or SIGTERM and a drain; returns the exit status."""
    import faulthandler

    import uvloop

    faulthandler.enable(all_threads=True)  # a crash in NIXL/UCX leaves every stack in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every stack

    logging.basicConfig(
        level=os.environ.get("KVXFER_LOG_LEVEL", config.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        sidecar = Sidecar(config)
    except ConfigError as e:  # e.g. an unreadable secret file: refuse to start rather than run open
        log.critical("%s", e)
        return 2
    try:
        uvloop.run(sidecar.serve())
    except OSError as e:  # a listener could not bind
        log.critical("cannot start: %s", e)
        return 2
    return sidecar.exit_code
