"""The daemon: builds the sidecar's parts in dependency order, wires what each part
announces to whoever must hear it, and runs the loops. No part holds a reference back to
this object.

The parts, lowest first: the NIXL port (``nixl_port``: the one door to NIXL, on its own
thread), the registry of local ranks, the lifecycle; the peer book, the holds (prefill
leases), the peer client and server (``peer_client``, ``peer_server``), the receiver
(decode side); the engine socket (``engine_server``) and the engines' registrations and
deaths (``engines``); the control plane's ``Operations``. The asyncio loop owns sockets and
timers; NIXL calls go through the port, which posts a small read from the loop itself
(bounded by ``--inline-read-kib``, never while its thread is in NIXL).

Request flow (pull model): the prefill engine ``Hold``s blocks under a lease; the decode
engine sends ``Recv`` naming the prefill sidecar's handshake endpoint; this side
handshakes once per peer, posts chunked NIXL READs, answers ``Done`` or ``Failed`` with
the exact local block ids, and sends the prefill sidecar a ``ReadNotice`` over NIXL,
which releases the lease there (``Released``) — or the lease expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from kvxfer import __version__
from kvxfer.abandoned import Abandoned
from kvxfer.config import Config
from kvxfer.errors import ListenError
from kvxfer.logs import JsonFormatter
from kvxfer.memchannel import mem_socket_path
from kvxfer.observe import Event, Observer, start_metrics_server
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Hold,
    HoldsCheck,
    KeepAlive,
    LayersDone,
    Ping,
    Pong,
    Recv,
    RegisterKV,
    Release,
    Unregister,
)
from kvxfer.sidecar.engine_rings import EngineRings
from kvxfer.sidecar.engine_server import EngineServer, ipc_path, storm_proof
from kvxfer.sidecar.engines import Advertised, Engines
from kvxfer.sidecar.holds import Holds, unknown_holds
from kvxfer.sidecar.keepalive import LeaseKeeper
from kvxfer.sidecar.lease_words import LeaseWords
from kvxfer.sidecar.lifecycle import Lifecycle, LifecycleView
from kvxfer.sidecar.loop_lag import heartbeat
from kvxfer.sidecar.nixl_agent import cuda_ucx_defaults
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import NoticeReceived, ReadFinished, ReadRefused, ReadStuck, TransferOptions
from kvxfer.sidecar.operations import Operations, Parts
from kvxfer.sidecar.peer_book import Authenticated, PeerBook
from kvxfer.sidecar.peer_client import PeerChannel, PeerClient
from kvxfer.sidecar.peer_server import PeerServer
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.sidecar.staging import Books
from kvxfer.sidecar.stall_guard import StallGuard
from kvxfer.sidecar.stream_server import StreamServer
from kvxfer.systemd import Notifier
from kvxfer.transfer_gauges import read_path_gauges, staging_gauges

log = logging.getLogger("kvxfer.sidecar")  # (the name operators filter on)
EXIT_STUCK = 3  # a failed read's chunks could not be stopped: restart to fence them off


def transfer_options(config: Config, words: LeaseWords | None = None) -> TransferOptions:
    """The NIXL port's options; with ``--cuda``, UCX's options for GPU memory are set too,
    before anything loads UCX (its global options, the memtype cache among them, are read
    once, when libucs loads, and ``Observer``'s build info loads it): call it first."""
    if config.cuda_enabled:
        cuda_ucx_defaults(os.environ)
    return TransferOptions(
        ucx_error_mode=config.ucx_error_mode, num_threads=config.nixl_threads,
        chunk_bytes=config.chunk_mib << 20, max_inflight_chunks=config.max_inflight_chunks,
        merge_runs=config.merge_runs, idle_poll_s=config.idle_poll_ms / 1000.0,
        active_poll_s=config.active_poll_ms / 1000.0, settle_timeout_s=config.settle_timeout_s,
        cuda=config.cuda_enabled, notice_fences=config.notice_fences,
        # (posting from the loop's thread is verified on host memory only: with CUDA the
        # NIXL thread stays the only one that drives NIXL)
        inline_bytes=0 if config.cuda_enabled else config.inline_read_kib << 10,
        inline_alone_bytes=0 if config.cuda_enabled else config.inline_alone_read_kib << 10,
        staging_bytes=config.staging_mib << 20, vram_staging_bytes=config.vram_staging_mib << 20,
        lease_words=(words.addr, words.nbytes) if words is not None and not config.cuda_enabled else (0, 0))


class Coalesced:
    """Call ``fn`` once at the end of this loop turn, however many times it was asked for
    (a round of 64 receives used to recompute the gauges 128 times, each a sum over every
    receive in flight). Outside a running loop (tests, shutdown) it calls at once."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._due: asyncio.AbstractEventLoop | None = None  # the loop a call is scheduled on

    def __call__(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._fn()
            return
        if self._due is loop:  # (a call scheduled on a loop that closed before running it: again)
            return
        self._due = loop
        loop.call_soon(self._run)

    def _run(self) -> None:
        self._due = None
        self._fn()


class Sidecar:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine_id = config.resolved_engine_id
        self.agent_name = f"kvxfer-{self.engine_id}-{secrets.token_hex(4)}"
        # how peers are authenticated (secret, host key or --insecure): refused before anything is opened
        self.channel = PeerChannel.for_config(config, self.engine_id, self.agent_name)
        self.secret, self.host_key = self.channel.secret, self.channel.local_only
        self.insecure = not self.secret
        self.ctx = zmq.asyncio.Context()
        self.dial_ctx = zmq.asyncio.Context()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._loops: list[asyncio.Future[Any]] = []
        self._idle = asyncio.Event()  # nothing in flight, nothing held (lifecycle: not busy)
        self._idle.set()
        self.exit_code = 0
        self.systemd = Notifier()
        self.hs_sock: zmq.asyncio.Socket | None = None
        self._build()

    def _build(self) -> None:
        """Every part, lowest layer first; each gets what it uses, nothing gets the app."""
        config, secret = self.config, self.secret
        # the memory channel (ipc:// engine sockets), listening once the engine socket is ours
        self.pools = (PoolServer(mem_socket_path(config.engine_socket), config.max_pool_bytes)
                      if ipc_path(config.engine_socket) else None)
        # the lease words its readers prove its leases with (kvxfer.sidecar.lease_words)
        self.words = LeaseWords(config.lease_word_slots) if config.lease_word_slots else None
        self.nixl = NixlPort(self.agent_name, transfer_options(config, self.words), self.pools)  # (pre-UCX)
        self.observer = Observer()
        self.registry = RankRegistry(self.engine_id, self.nixl)
        self.lifecycle = Lifecycle()
        self.abandoned = Abandoned()  # what engines gave up on when this sidecar (re)started
        self.advertised = Advertised(config.resolved_advertise_host, config.handshake_port, self.agent_name)
        self.book = PeerBook()
        self.authenticated = Authenticated(secret)
        self.holds = Holds(config, self.registry, self.observer, authenticated=self.authenticated,
                           abandoned=self.abandoned, words=self.words)
        words = (0, 0) if self.words is None or config.cuda_enabled else (self.words.addr, self.words.slots)
        self.peers = PeerClient(config=config, channel=self.channel, dial_ctx=self.dial_ctx, book=self.book,
                                registry=self.registry, nixl=self.nixl, observer=self.observer)
        generation = lambda: self.registry.generation(self.agent_name)  # noqa: E731
        self.streams = StreamServer(config=config, registry=self.registry, holds=self.holds,  # (push)
                                    observer=self.observer, generation=generation)
        books = Books(self.nixl.spans)  # (the staging arenas' slots: one book for both halves)
        self.peer_server = PeerServer(channel=self.channel, registry=self.registry, holds=self.holds,
                                      nixl=self.nixl, observer=self.observer,
                                      authenticated=self.authenticated, generation=generation,
                                      lease_words=words, streams=self.streams, books=books)
        self.engine_server = EngineServer(self.ctx, config.engine_socket, self.observer)
        self.rings = EngineRings(self.engine_server, self.observer)
        self.receiver = Receiver(config=config, registry=self.registry, peers=self.peers, book=self.book,
                                 nixl=self.nixl, observer=self.observer, send=self.engine_server.send,
                                 spawn=self._spawn, agent_name=self.agent_name, abandoned=self.abandoned,
                                 books=books, waiting=self.rings.waiting)
        self.stalls = StallGuard(config, self.peers, self.book, self.receiver.reading_from)
        self.keeper = LeaseKeeper(config, self.peers, self.book, self.engine_server.send, self.agent_name)
        self.engines = Engines(config=config, registry=self.registry, receiver=self.receiver,
                               holds=self.holds, pools=self.pools, abandoned=self.abandoned,
                               server=self.engine_server, observer=self.observer, advertised=self.advertised)
        self.ops = Operations(Parts(
            config=config, engine_id=self.engine_id, started=time.monotonic(), advertised=self.advertised,
            channel=self.channel, insecure=self.insecure, host_key=self.host_key,
            lifecycle=self.lifecycle, observer=self.observer,
            registry=self.registry, nixl=self.nixl, book=self.book, peers=self.peers, holds=self.holds,
            receiver=self.receiver, idle=self._idle))
        self._wire()

    def _wire(self) -> None:
        """Who hears what: NIXL events, engine messages, and every part's changes."""
        self.nixl.on(NoticeReceived, self.peer_server.on_notice)
        self.nixl.on(ReadFinished, self.receiver.on_read_finished)
        self.nixl.on(ReadRefused, self.receiver.on_read_refused)
        self.nixl.on(ReadStuck, self._read_stuck)
        es = self.engine_server
        es.on(Ping, lambda ident, msg: es.send(ident, self._pong(msg.seq)))
        # (es.sender: the sending process, as the kernel reported it; who may act for an engine)
        es.on(Hold, lambda ident, msg: self.streams.hold(ident, msg, self.lifecycle.draining, es.sender))
        es.on(LayersDone, lambda ident, msg: self.streams.on_layers(msg, es.sender))
        es.on(Recv, lambda ident, msg: self.receiver.on_recv(ident, msg, es.sender, self.lifecycle.draining,
                                                             es.received_ns))
        es.on(Release, lambda ident, msg: self.holds.release_request(msg, es.sender))
        es.on(HoldsCheck, lambda i, m: unknown_holds(self.holds, m, es.sender, functools.partial(es.send, i)))
        es.on(Cancel, lambda ident, msg: self.receiver.on_cancel(msg, es.sender))
        es.on(RegisterKV, lambda ident, msg: self._spawn(self.engines.register(ident, msg, es.sender)))
        es.on(KeepAlive, lambda ident, msg: self._spawn(self.keeper.keepalive(ident, msg)))
        es.on(Unregister, lambda ident, msg: self.engines.unregister(ident, msg, es.sender))
        self.holds.changed.subscribe(self._holds_changed)
        gauges = Coalesced(self._gauges)  # (once per loop turn, whichever parts changed)
        for part in (self.holds, self.receiver, self.engines):
            part.changed.subscribe(gauges)
        self.lifecycle.subscribe(self._lifecycle_changed)
        o = self.observer
        # (read from the metrics thread: lengths and ints only, never an iteration)
        o.g_dlists.set_function(lambda: self.nixl.counts[0])
        o.g_agents.set_function(lambda: self.nixl.counts[1])
        o.g_pools.set_function(lambda: self.pools.stats()[0] if self.pools else 0)
        o.g_pool_bytes.set_function(lambda: self.pools.stats()[1] if self.pools else 0)
        o.g_peers.set_function(lambda: len(self.book))
        o.g_leases.set_function(lambda: len(self.holds))
        o.g_inflight.set_function(lambda: len(self.receiver.recvs))
        staging_gauges(o.registry, self.receiver.staging.counts, lambda: self.peer_server.stager.slots,
                       lambda: (sum(n for _, n in self.nixl.spans.copy().values()), self.nixl.counts[2]),
                       self.peer_server.stager.times.row)
        read_path_gauges(o.registry, self.nixl.read_path)

    # ------------------------------------------------------------------ life

    async def open(self) -> None:
        """Bind every listener, then start NIXL. One that cannot bind says which and where
        (ListenError: the process exits 2) with everything already closed again."""
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
        await self.nixl.start()
        self.lifecycle.started()
        self.observer.g_insecure.set(int(self.insecure))
        if self.insecure:
            log.warning("INSECURE: the handshake listener on %s:%d takes anyone, any local user "
                        "included: no shared secret, no host key (--insecure)",
                        self.config.handshake_host, self.advertised.port)
        elif self.host_key:
            log.info("handshakes authenticated with the host key %s (no shared secret: peers "
                     "must be sidecars of this user on this host)", self.config.resolved_host_key_file)
        elif self.secret and self.channel.curve is None and not self.config.handshake_is_local:
            log.warning("the handshake channel on %s:%d is not encrypted (handshake_encryption=none): "
                        "NIXL metadata crosses the network in clear", self.config.handshake_host,
                        self.advertised.port)

    async def run(self, on_hup: Callable[[], None] | None = None) -> None:
        """Serve until stopped (SIGINT, or SIGTERM and a drain); then every loop and task of
        this sidecar is cancelled. ``close`` releases the rest."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, self._stop.set)  # operator: stop now
            loop.add_signal_handler(signal.SIGTERM, self._graceful_stop)  # orchestrator
            if on_hup is not None:
                loop.add_signal_handler(signal.SIGHUP, on_hup)  # re-read the log level
        print_ready(self.config, self.engine_id, self.advertised, self.agent_name)
        assert self.hs_sock is not None, "open() first"
        self._loops = [asyncio.ensure_future(coro) for coro in (
            self.engine_server.serve(), self.rings.serve(), self.peer_server.serve(self.hs_sock),
            self.holds.run(), self._engine_watch_loop())]
        self._loops.append(asyncio.ensure_future(heartbeat(self.systemd, self.observer, self._status_line)))
        if self.stalls.enabled:
            self._loops.append(asyncio.ensure_future(self.stalls.run()))
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
        await asyncio.to_thread(self.nixl.stop)
        self._close()

    def request_stop(self) -> None:
        self._stop.set()

    def _bind(self) -> None:
        self.engine_server.bind()
        self.rings.bind()
        if self.pools is not None:
            # the memory channel beside the engine socket: the engine's KV pools, handed over by fd
            loop = asyncio.get_running_loop()
            self.pools.on_closed = lambda ids, pid: loop.call_soon_threadsafe(
                self._spawn, self.engines.pools_closed(set(ids), pid))
            self.pools.on_refused = lambda cap: self.observer.connection_refused("memory", cap)
            self.pools.start()
        self.hs_sock = self.ctx.socket(zmq.ROUTER)
        self.hs_sock.setsockopt(zmq.LINGER, 0)
        self.hs_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a Hello is a few hundred bytes
        storm_proof(self.hs_sock)
        self.peer_server.configure(self.hs_sock)
        addr = f"tcp://{self.config.handshake_host}"
        try:
            if self.config.handshake_port == 0:
                self.advertised.port = self.hs_sock.bind_to_random_port(addr)
            else:
                self.hs_sock.bind(f"{addr}:{self.config.handshake_port}")
        except zmq.ZMQError as e:
            where = f"{self.config.handshake_host}:{self.config.handshake_port}"
            raise ListenError(f"handshake listener {where}: {e} (--handshake-port, "
                              "--handshake-host)") from None

    def _close(self) -> None:
        self.peers.close()
        self.rings.close()
        self.engine_server.close()
        if self.hs_sock is not None:
            self.hs_sock.close(0)
        self.ctx.term()
        self.dial_ctx.term()
        if self.pools is not None:
            self.pools.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _loop_died(self, task: asyncio.Task[Any]) -> None:
        """A serving loop must never end while running: log why and stop (the supervisor restarts)."""
        if task.cancelled() or self._stop.is_set():
            return
        log.critical("serving loop %s died: %r; stopping", task, task.exception(), exc_info=task.exception())
        self.exit_code = 1
        self._stop.set()

    def _graceful_stop(self) -> None:
        """SIGTERM: readiness off, drain within drain_timeout_s, then stop."""
        self.systemd.stopping("draining")
        self.lifecycle.stop()  # (before the drain: a Resume from now on is refused)

        async def run() -> None:
            drained, failed, released, took = await self.ops.drain(self.config.drain_timeout_s)
            log.warning("drained in %.2fs (failed %d receives, released %d holds); stopping",
                        took, failed, released)
            self._stop.set()

        self._spawn(run())

    # ------------------------------------------------------------------ what the parts announce

    def _pong(self, seq: int) -> Pong:
        a = self.advertised
        return Pong(seq=seq, engine_id=self.engine_id, version=PROTOCOL_VERSION, handshake_host=a.host,
                    handshake_port=a.port, instance=self.agent_name,
                    generation=self.registry.generation(self.agent_name), grouped_streams=True,
                    chunk_streams=True, grouped_chunks=True, holds_check=True)

    def _holds_changed(self) -> None:
        for out in self.holds.take_outbox():
            for ident in out.targets:
                self.engine_server.send(ident, out.message)

    def _gauges(self) -> None:
        """After any change of holds, receives or registrations: what is computed from them."""
        self.observer.g_inflight_bytes.set(sum(r.nbytes for r in self.receiver.recvs.values()))
        entries = self.registry.entries()
        self.observer.g_ranks.set(sum(not e.orphaned for e in entries))
        self.observer.g_orphans.set(sum(e.orphaned for e in entries))
        self.nixl.set_serving(bool(len(self.holds)))
        self.lifecycle.engines_registered(any(not e.orphaned for e in entries))
        self.lifecycle.work(bool(self.receiver.recvs) or bool(len(self.holds)))

    def _lifecycle_changed(self, before: LifecycleView, after: LifecycleView) -> None:
        self.observer.g_ready.set(int(after.ready))
        if after.busy:
            self._idle.clear()
        else:
            self._idle.set()

    def _read_stuck(self, event: ReadStuck) -> None:
        # NIXL cannot stop this read's chunks: a failure reported now would let the engine reuse
        # blocks they may still write, so exit (no teardown: it could block); the supervisor restarts us.
        log.critical("read %s from %s still has chunks in flight %.1fs after it failed; exiting "
                     "so that no late write can land in reused blocks", event.req_id, event.peer,
                     event.seconds)
        self.exit_code = EXIT_STUCK
        hard_exit(EXIT_STUCK)

    def _status_line(self) -> str:
        t = self.observer.totals
        state = "draining" if self.lifecycle.draining else "serving"
        return (f"{state}: {len(self.registry)} ranks, {len(self.book)} peers, {len(self.holds)} held, "
                f"{len(self.receiver.recvs)} in flight, {t.transfers_ok} transfers, "
                f"{t.transfers_failed} failed")

    # ------------------------------------------------------------------ timers

    async def _engine_watch_loop(self) -> None:
        """The engine socket file still ours, engine processes alive, orphans freed."""
        while True:
            await asyncio.sleep(self.config.engine_check_s)
            intact, how = self.engine_server.intact()
            if not intact and self.lifecycle.view.listening:
                self.lifecycle.socket_lost()  # readiness off, on gRPC health too
                log.error("engine socket %s was %s: engines cannot reach this sidecar; readiness off "
                          "(restart it to listen again)", self.engine_server.path, how)
                self.observer.emit(Event("engine_socket_lost", reason=self.engine_server.path or ""))
            await self.engines.check()


def hard_exit(code: int) -> None:
    """Flush the log and leave now: no teardown, no atexit, no waiting on any thread."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def print_ready(c: Config, engine_id: str, advertised: Advertised, agent_name: str) -> None:
    """The one line a starting sidecar prints, whatever the log level (scripts wait for it)."""
    ready = (f"kvxfer {__version__} ready: engine_id={engine_id} engine_socket={c.engine_socket} "
             f"handshake={advertised.host}:{advertised.port} agent={agent_name} "
             f"ucx_error_mode={c.ucx_error_mode} control={c.control_target or '-'} "
             f"metrics_port={c.metrics_port or '-'}")
    if c.log_format == "json":  # (printed whatever the log level)
        record = logging.LogRecord(log.name, logging.INFO, __file__, 0, ready, None, None)
        ready = JsonFormatter().format(record)
    print(ready, file=sys.stderr, flush=True)
