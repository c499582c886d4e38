"""The sidecar daemon: the asyncio front end over the NIXL thread.

It owns three things and nothing else: the engine socket (ZMQ ROUTER on ``ipc://``,
0600), the peer handshake listener (ZMQ ROUTER on TCP), and the timers (leases). NIXL
calls go through ``TransferEngine.call``, except a small read, which this loop posts
itself (``TransferEngine.read_now``: bounded by ``--inline-read-kib``, never while the NIXL
thread is in NIXL); it never waits for the NIXL thread.

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
import copy
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvxfer import __version__
from kvxfer.abandoned import Abandoned
from kvxfer.auth import curve_server_keys
from kvxfer.config import Config
from kvxfer.errors import ConfigError, ErrorCode, ListenError, RequestError
from kvxfer.holds import Holds
from kvxfer.logs import JsonFormatter
from kvxfer.memchannel import mem_socket_path
from kvxfer.observe import Event, Observer, start_metrics_server
from kvxfer.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    CudaIpcMemory,
    Error,
    Hold,
    KeepAlive,
    Ping,
    Pong,
    Recv,
    Registered,
    RegisterKV,
    Release,
    ShmMemory,
    Unregister,
    encode,
    engine_request_decoder,
)
from kvxfer.registry import RankEntry, RankRegistry
from kvxfer.sidecar.keepalive import LeaseKeeper
from kvxfer.sidecar.lifecycle import Lifecycle, LifecycleView
from kvxfer.sidecar.mapping import check_shm_files
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import NoticeReceived, ReadFinished, ReadRefused, ReadStuck, TransferOptions
from kvxfer.sidecar.peer_book import Authenticated, Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerChannel, PeerClient
from kvxfer.sidecar.peer_server import PeerServer
from kvxfer.sidecar.pool_server import PoolServer, unlink_if_same
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.validate import validate_registration
from kvxfer.status import LeaseView, Snapshot, TransferView, copies
from kvxfer.systemd import Notifier
from kvxfer.topology import (
    Incompatible,
    check_layout,
)

log = logging.getLogger("kvxfer.sidecar")  # (the name operators filter on)
EXIT_STUCK = 3  # a failed read's chunks could not be stopped: restart to fence them off

_ENGINE_TAGS = {"register", "unregister", "hold", "release", "recv", "ping", "keepalive"}
MAX_MESSAGE = 16 << 20  # larger engine messages get a typed error (a million block ids is ~5 MiB)
HARD_MAX_MESSAGE = 64 << 20  # ZMQ drops the connection of a peer that sends more


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


class Sidecar:
    """The daemon: owns the sockets, the NIXL thread and the lifecycle, and composes the
    parts that do the work, each with its dependencies passed in: ``registry`` (registered
    ranks), ``holds`` (prefill leases), ``peers`` (dialer and listener), ``receiver`` (the
    receive state machine). The control plane reads ``snapshot()``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine_id = config.resolved_engine_id
        self.agent_name = f"kvxfer-{self.engine_id}-{secrets.token_hex(4)}"
        self.started = time.monotonic()
        # refused before anything is opened
        self.secret = config.load_secret()
        self.insecure = not self.secret and not config.handshake_is_local
        if self.insecure and not config.insecure:
            raise ConfigError(
                f"the handshake listener would bind {config.handshake_host!r}, beyond loopback, with no "
                "shared secret: anyone who reaches it could read and release this engine's KV cache. "
                "Set secret_file (--secret-file) or KVXFER_SECRET on every sidecar, or pass --insecure "
                "to run open on purpose")
        self.ctx = zmq.asyncio.Context()
        self.dial_ctx = zmq.asyncio.Context()
        self.engine_sock: zmq.asyncio.Socket | None = None
        # the memory channel (ipc:// engine sockets), listening once the engine socket is ours
        self.pools = (PoolServer(mem_socket_path(config.engine_socket), config.max_pool_bytes)
                      if ipc_path(config.engine_socket) else None)
        self.hs_sock: zmq.asyncio.Socket | None = None
        self._lock_fd = -1  # <engine socket>.lock, flocked while this process owns the socket
        self._sock_ino = 0  # the inode of the socket file this process bound (0: none)
        self.handshake_port = config.handshake_port
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0  # threading.get_ident() of the loop's thread, once it runs
        opts = TransferOptions(
            ucx_error_mode=config.ucx_error_mode,
            num_threads=config.nixl_threads,
            chunk_bytes=config.chunk_mib << 20,
            max_inflight_chunks=config.max_inflight_chunks,
            merge_runs=config.merge_runs,
            idle_poll_s=config.idle_poll_ms / 1000.0,
            active_poll_s=config.active_poll_ms / 1000.0,
            settle_timeout_s=config.settle_timeout_s,
            cuda=config.cuda_enabled,
            # (posting from the loop's thread is verified on host memory only: with CUDA the
            # NIXL thread stays the only one that drives NIXL)
            inline_bytes=0 if config.cuda_enabled else config.inline_read_kib << 10,
        )
        self.transfer = NixlPort(self.agent_name, opts, self.pools)
        self.registry = RankRegistry(self.engine_id, self.transfer)
        self.observer = Observer()
        self.observer.g_dlists.set_function(lambda: self.transfer.dlists_prepared)
        self.observer.g_inline.set_function(lambda: self.transfer.reads_inline)
        self.observer.g_ranks.set_function(lambda: sum(not e.orphaned for e in self.registry.entries()))
        self.observer.g_orphans.set_function(lambda: len(self.registry.orphans()))
        self.observer.g_pools.set_function(lambda: self.pools.stats()[0] if self.pools else 0)
        self.observer.g_pool_bytes.set_function(lambda: self.pools.stats()[1] if self.pools else 0)
        self.systemd = Notifier()
        self.lifecycle = Lifecycle()
        self.lifecycle.subscribe(self._lifecycle_changed)
        self.abandoned = Abandoned()  # what engines gave up on when this sidecar (re)started
        # the peer conversation: one book of peers, a client that dials, a server that listens
        self.channel = PeerChannel(self.engine_id, self.agent_name, self.secret,
                                   curve_server_keys(self.secret)
                                   if self.secret and config.handshake_encryption != "none" else None)
        self.book = PeerBook()
        self.authenticated = Authenticated(self.secret)
        self.holds = Holds(config, self.registry, self.observer, self._send, self._gauges,
                           authenticated=self.authenticated, abandoned=self.abandoned)
        self.peers = PeerClient(config=config, channel=self.channel, dial_ctx=self.dial_ctx, book=self.book,
                                registry=self.registry, nixl=self.transfer, observer=self.observer)
        self.peer_server = PeerServer(channel=self.channel, registry=self.registry, holds=self.holds,
                                      nixl=self.transfer, observer=self.observer,
                                      authenticated=self.authenticated,
                                      generation=lambda: self.registry.generation(self.agent_name))
        self.receiver = Receiver(config=config, registry=self.registry, peers=self.peers, book=self.book,
                                 nixl=self.transfer, observer=self.observer,
                                 send=self._send, spawn=self._spawn,
                                 on_change=self._gauges, agent_name=self.agent_name,
                                 abandoned=self.abandoned)
        self.keeper = LeaseKeeper(config, self.peers, self.book, self._send, self.agent_name)
        self.transfer.on(NoticeReceived, lambda ev: self.holds.on_notice(ev.agent, ev.payload))
        self.transfer.on(ReadFinished, self.receiver.on_read_finished)
        self.transfer.on(ReadRefused, self.receiver.on_read_refused)
        self.transfer.on(ReadStuck, self._read_stuck)
        self._idle = asyncio.Event()  # nothing in flight, nothing held (lifecycle: not busy)
        self._idle.set()
        self.exit_code = 0
        self._loops: list[asyncio.Future[Any]] = []
        self._received_ns = 0  # when the engine message being handled arrived

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Bind every listener, then start NIXL. One that cannot bind says which and where
        (ListenError: the process exits 2) with everything already closed again."""
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self.config.metrics_port:
            # first: /metrics answers before any engine or peer can reach the sidecar, so
            # whatever they cause is already counted and scrapeable (kvxfer_ready says 0 until then)
            try:
                start_metrics_server(self.observer, self.config.metrics_host, self.config.metrics_port)
            except OSError as e:
                self._close()
                raise ListenError(f"metrics listener {self.config.metrics_host}:{self.config.metrics_port}: "
                                  f"{e.strerror or e} (--metrics-port; 0 disables it)") from None
        try:
            self._bind()
        except BaseException:
            self._close()
            raise
        await self.transfer.start()
        self.lifecycle.started()
        self.observer.g_insecure.set(int(self.insecure))
        if self.insecure:
            log.warning("INSECURE: the handshake listener on %s:%d takes anyone: no shared secret "
                        "(--insecure)", self.config.handshake_host, self.handshake_port)
        elif self.secret and self.channel.curve is None and not self.config.handshake_is_local:
            log.warning("the handshake channel on %s:%d is not encrypted (handshake_encryption=none): "
                        "NIXL metadata crosses the network in clear", self.config.handshake_host,
                        self.handshake_port)

    async def run(self, on_hup: Callable[[], None] | None = None) -> None:
        """Serve until stopped (SIGINT, or SIGTERM and a drain); then every loop and task of
        this sidecar is cancelled. ``close`` releases the rest."""
        assert self.loop is not None, "open() first"
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.loop.add_signal_handler(signal.SIGINT, self._stop.set)  # operator: stop now
            self.loop.add_signal_handler(signal.SIGTERM, self._graceful_stop)  # orchestrator
            if on_hup is not None:
                self.loop.add_signal_handler(signal.SIGHUP, on_hup)  # re-read the log level
        ready = (
            f"kvxfer {__version__} ready: engine_id={self.engine_id} "
            f"engine_socket={self.config.engine_socket} "
            f"handshake={self.config.resolved_advertise_host}:{self.handshake_port} "
            f"agent={self.agent_name} ucx_error_mode={self.config.ucx_error_mode} "
            f"control={self.config.control_target or '-'} metrics_port={self.config.metrics_port or '-'}"
        )
        if self.config.log_format == "json":  # (printed whatever the log level)
            record = logging.LogRecord(log.name, logging.INFO, __file__, 0, ready, None, None)
            ready = JsonFormatter().format(record)
        print(ready, file=sys.stderr, flush=True)
        self._loops = [
            asyncio.ensure_future(self._engine_loop()),
            asyncio.ensure_future(self.peer_server.serve(self.hs_sock)),
            asyncio.ensure_future(self.holds.run()),
            asyncio.ensure_future(self._engine_watch_loop()),
        ]
        if self.systemd.enabled:
            self._loops.append(asyncio.ensure_future(self._systemd_loop()))
        for task in self._loops:
            task.add_done_callback(self._loop_died)
        self.systemd.ready(self._status_line())
        try:
            await self._stop.wait()
        finally:
            self.systemd.stopping("stopping")
            for t in self._loops + list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the NIXL thread and close every socket and file this sidecar opened."""
        await asyncio.to_thread(self.transfer.stop)
        self._close()

    def _lifecycle_changed(self, before: LifecycleView, after: LifecycleView) -> None:
        self.observer.g_ready.set(int(after.ready))
        if after.busy:
            self._idle.clear()
        else:
            self._idle.set()

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

    def _own_socket(self, path: str) -> None:
        """Take ``<path>.lock`` (flock, held for the life of the process) or refuse: a second
        sidecar on the same engine socket would take it over silently and delete it when it
        exits, leaving the first one unreachable but still reporting ready."""
        import fcntl

        lock = path + ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ListenError(f"engine socket {path} belongs to a running sidecar (pid {holder}, "
                              f"holding {lock}): stop it first, or give this one another "
                              "--engine-socket") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

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
            self._own_socket(path)
            old = os.umask(0o177)
            try:
                self.engine_sock.bind(self.config.engine_socket)
            except zmq.ZMQError as e:
                raise ListenError(f"engine socket {self.config.engine_socket}: {e}") from None
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            self._sock_ino = os.stat(path).st_ino
            # the memory channel beside it: the engine's KV pools, handed over by fd
            assert self.pools is not None
            loop = self.loop
            assert loop is not None
            self.pools.on_closed = lambda ids, pid: loop.call_soon_threadsafe(
                self._spawn, self._pools_closed(set(ids), pid))
            self.pools.start()
        else:
            try:
                self.engine_sock.bind(self.config.engine_socket)
            except zmq.ZMQError as e:
                raise ListenError(f"engine socket {self.config.engine_socket}: {e}") from None
        self.hs_sock = self.ctx.socket(zmq.ROUTER)
        self.hs_sock.setsockopt(zmq.LINGER, 0)
        self.hs_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a Hello is a few hundred bytes
        self.peer_server.configure(self.hs_sock)
        addr = f"tcp://{self.config.handshake_host}"
        try:
            if self.config.handshake_port == 0:
                self.handshake_port = self.hs_sock.bind_to_random_port(addr)
            else:
                self.hs_sock.bind(f"{addr}:{self.config.handshake_port}")
        except zmq.ZMQError as e:
            where = f"{self.config.handshake_host}:{self.config.handshake_port}"
            raise ListenError(f"handshake listener {where}: {e} (--handshake-port, "
                              "--handshake-host)") from None

    def _close(self) -> None:
        self.peers.close()
        for sock in (self.engine_sock, self.hs_sock):
            if sock is not None:
                sock.close(0)
        self.ctx.term()
        self.dial_ctx.term()
        if self.pools is not None:
            self.pools.close()
        path = ipc_path(self.config.engine_socket)
        if path:
            unlink_if_same(path, self._sock_ino)  # never a socket this process did not bind
            self._sock_ino = 0
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # (the lock file stays: unlinking it would race a successor)
            self._lock_fd = -1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ engine socket

    def _send(self, ident: bytes, msg: Any) -> None:
        assert self.engine_sock is not None
        try:
            self.engine_sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("engine connection %r is not reading; dropped %s", ident, type(msg).__name__)

    async def _engine_loop(self) -> None:
        assert self.engine_sock is not None
        while True:
            frames = await self.engine_sock.recv_multipart()
            self._received_ns = time.monotonic_ns()  # (the trace's "sidecar" hop)
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
                self.holds.hold(ident, msg, self.lifecycle.draining)
            case Recv():
                self.receiver.on_recv(ident, msg, self.lifecycle.draining, self._received_ns)
            case Release():
                self.holds.release_request(msg)
            case RegisterKV():
                self._spawn(self._on_register(ident, msg))
            case KeepAlive():
                self._spawn(self.keeper.keepalive(ident, msg))
            case Unregister(tp_rank=rank):
                entry = self.registry.find(msg.engine_id, msg.pp_rank, rank)
                if entry is None or entry.owner != ident:
                    raise RequestError(ErrorCode.NOT_REGISTERED, f"rank pp{msg.pp_rank}/tp{rank} of engine "
                                       f"{self.registry.engine_of(msg.engine_id)!r} is not registered by "
                                       "this connection")
                await self.registry.remove(entry.key)
                self._gauges()

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
        """This sidecar's registration generation (``RankRegistry.generation``)."""
        return self.registry.generation(self.agent_name)

    async def _on_register(self, ident: bytes, msg: RegisterKV) -> None:
        """Register a rank (``RankRegistry``: a failed re-registration unregisters the key,
        whose old memory is already gone, and moves the generation)."""
        try:
            validate_registration(msg)
            check_shm_files(msg, self.config.shm_dir_list)
            try:
                check_layout(msg.layout)
            except Incompatible as e:
                raise RequestError(ErrorCode.INVALID_LAYOUT, str(e)) from None
            if msg.abandoned:  # before the rank is registered: none of them can be read or held
                engine = self.registry.engine_of(msg.engine_id)
                for_s = msg.abandoned_s or self.config.transfer_timeout_s + 60.0
                self.abandoned.add(engine, list(msg.abandoned), for_s)
                log.info("%s: %d requests its engine gave up on (loads failed, holds freed) are refused "
                         "for %.0fs if they arrive", engine, len(msg.abandoned), for_s)
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
        if any(isinstance(m, ShmMemory) for m in msg.memory):
            log.warning("%s registered engine-owned files (%s): the legacy path; a SIGKILLed engine "
                        "leaves them in RAM while this sidecar is down. Allocate the KV cache from "
                        "the memory channel instead (the connector's get_mem_pool_context)", entry.key,
                        ", ".join(m.path for m in msg.memory if isinstance(m, ShmMemory)))
        elif any(isinstance(m, CudaIpcMemory) for m in msg.memory):
            log.info("%s registered engine-owned VRAM over CUDA IPC (UCX cannot re-export it; "
                     "gpu_memory 'vmm' gives it sidecar-owned VMM pools instead)", entry.key)
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
        self._gauges()

    def _gauges(self) -> None:
        o = self.observer
        recvs = self.receiver.recvs
        o.g_inflight.set(len(recvs))
        o.g_inflight_bytes.set(sum(r.nbytes for r in recvs.values()))
        o.g_leases.set(len(self.holds))
        o.g_peers.set(len(self.book))
        self.transfer.set_serving(bool(len(self.holds)))
        self.lifecycle.engines_registered(any(not e.orphaned for e in self.registry.entries()))
        self.lifecycle.work(bool(recvs) or bool(len(self.holds)))

    def _read_stuck(self, event: ReadStuck) -> None:
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

    def _status_line(self) -> str:
        t = self.observer.totals
        state = "draining" if self.lifecycle.draining else "serving"
        return (f"{state}: {len(self.registry)} ranks, {len(self.book)} peers, "
                f"{len(self.holds)} held, "
                f"{len(self.receiver)} in flight, {t.transfers_ok} transfers, {t.transfers_failed} failed")

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
        """Notice engine processes that died (their receives fail; their held blocks stay
        readable until those leases end), and remove orphaned ranks nobody holds any more."""
        while True:
            await asyncio.sleep(self.config.engine_check_s)
            await self._check_socket()
            for entry in self.registry.dead():
                await self._engine_gone(entry, f"engine process {entry.pid} exited")
            for entry in self.registry.orphans():
                if not self.holds.engine_holds(entry.key.engine):
                    log.warning("%s: the last lease of its dead engine ended; freeing its memory", entry.key)
                    await self.registry.remove(entry.key, unlink=True)
                    self._gauges()

    async def _pools_closed(self, pools: set[str], pid: int) -> None:
        """An engine's memory channel closed with pools in it: the engine is gone, whatever
        PID namespace it ran in (its pid may mean nothing here)."""
        for entry in self.registry.in_pools(pools):
            if self.pools is not None and all(self.pools.holds(p) for p in entry.pools):
                continue  # handed back on a new connection meanwhile (a worker that reconnected)
            await self._engine_gone(entry, f"engine process {pid} exited (its memory channel closed; "
                                           "exited or killed)")

    async def _check_socket(self) -> None:
        """The engine socket file must still be the one this process bound: if it was
        removed or replaced, engines cannot reach this sidecar, so it is not ready."""
        path = ipc_path(self.config.engine_socket)
        if not path or not self._sock_ino or not self.lifecycle.view.listening:
            return
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            ino = 0
        if ino != self._sock_ino:
            self.lifecycle.socket_lost()  # readiness off, on gRPC health too
            log.error("engine socket %s was %s: engines cannot reach this sidecar; readiness off "
                      "(restart it to listen again)", path, "removed" if not ino else "replaced")
            self.observer.emit(Event("engine_socket_lost", reason=path))

    async def _engine_gone(self, entry: RankEntry, reason: str) -> None:
        await self.receiver.fail_rank(entry.key, reason)
        engine = entry.key.engine
        held = self.holds.engine_holds(engine)
        if held:
            # A finished prefill's KV is still the decode's to read: keep the rank's mapping
            # and NIXL registration (the memory lives while we map it) until its leases end.
            log.warning("%s: %s; %d held requests stay readable until read or expired, then its "
                        "memory is freed", entry.key, reason, held)
            entry.orphaned = True
        else:
            log.warning("%s: %s; dropping its registration and receives", entry.key, reason)
            await self.registry.remove(entry.key, unlink=True)  # the dead engine cannot remove its files
        self.observer.emit(Event("engine_gone", reason=f"{entry.key}: {reason}", tp_rank=entry.key.tp))
        self._gauges()

    # ------------------------------------------------------------------ control operations

    def snapshot(self) -> Snapshot:
        """Everything the control plane shows, copied now (call on the loop)."""
        now = time.monotonic()
        cfg = self.config
        leases = [LeaseView(req_id=x.req_id, engine=x.engine, num_blocks=len(x.block_ids),
                            age_s=now - x.created, expires_in_s=x.expires - now, reads_seen=x.reads_seen,
                            reads_expected=x.reads_expected)
                  for x in self.holds.table.items()]
        transfers = [TransferView(req_id=st.msg.req_id, tp_rank=st.msg.tp_rank, peer=st.peer, state=st.state,
                                  num_blocks=len(st.msg.block_ids), nbytes=st.nbytes, age_s=now - st.started,
                                  deadline_in_s=st.deadline - now)
                     for st in self.receiver.recvs.values()]
        return Snapshot(
            engine_id=self.engine_id, role=cfg.role, version=__version__,
            nixl_backends=list(self.transfer.backends),
            handshake_endpoint=f"{cfg.resolved_advertise_host}:{self.handshake_port}",
            agent_name=self.agent_name,
            protocol_version=PROTOCOL_VERSION, ucx_error_mode=cfg.ucx_error_mode, uptime_s=now - self.started,
            ready=self.lifecycle.ready, draining=self.lifecycle.draining, insecure=self.insecure,
            authenticated=bool(self.secret), encrypted=self.channel.curve is not None,
            ranks=copies(self.registry.entries()), peers=copies(self.book.values()), leases=leases,
            transfers=transfers, totals=copy.copy(self.observer.totals),
        )

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED,
                     reason: str = "cancelled by operator") -> int:
        """Fail every rank's receive of a request now (all with no id); returns how many."""
        return await self.receiver.cancel(req_id, code, reason)

    async def connect_peer(self, host: str, port: int) -> Peer:
        """Pre-warm: handshake now so the first request does not pay for it."""
        if not self.registry:
            raise RequestError(ErrorCode.NOT_REGISTERED,
                               "register the engine's KV cache first: the handshake carries its layout")
        peer = await self.peers.get_peer(host, port)
        self._gauges()
        return peer

    async def disconnect_peer(self, which: str) -> bool:
        """Forget a peer by endpoint (host:port) or engine id."""
        agents = {p.agent_name for k, p in self.book.items() if which in (k, p.engine_id)}
        dropped = False
        for agent in agents:
            dropped |= await self.peers.drop_peer(agent, "disconnected by operator")
        self._gauges()
        return dropped

    async def drain(self, timeout_s: float) -> tuple[bool, int, int, float]:
        """Refuse new holds/receives; wait for in-flight work; fail/release what is left."""
        start = time.monotonic()
        if self.lifecycle.drain():
            self.observer.emit(Event("drain_started"))
        self._gauges()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        failed = len(self.receiver)
        if failed:
            await self.receiver.cancel("", ErrorCode.DRAINING, "sidecar drained before the transfer finished")
        released = self.holds.release_all()
        took = time.monotonic() - start
        self.observer.emit(Event("drained", seconds=took))
        return failed == 0 and released == 0, failed, released, took

    async def resume(self) -> bool:
        """Undo a drain: new holds and receives are taken again. False: not draining."""
        if not self.lifecycle.resume():
            return False
        self.observer.emit(Event("resumed"))
        self._gauges()
        return True


def hard_exit(code: int) -> None:
    """Flush the log and leave now: no teardown, no atexit, no waiting on any thread."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


