"""The one door to NIXL: a dedicated thread that owns the agent, and a typed API the event
loop calls.

A CMA ``transfer()`` copies synchronously inside the call (~150 ms per GiB), so NIXL runs
on its own thread: the loop awaits ``register``, ``add_peer``, ``digest`` … (each a command
queued to that thread), and receives what happens there (``ReadFinished``,
``NoticeReceived``, ``ReadStuck``) through handlers it subscribed with ``on``, always on the
loop. The one exception is the hot path: a read of at most ``inline_bytes`` is planned and
posted by the loop itself, inside ``read`` (it saves the hand-off and the poll that sees it
land). NIXL calls from the two threads never overlap: each holds ``_lock`` while in NIXL
(the loop only tries it, and queues the read when the NIXL thread has it), and the agent
runs NIXL's strict synchronization, under which its UCX workers are SERIALIZED (any
thread, one at a time). Which of the two paths a read takes is this module's choice alone.

Progress (transfer states, notifications) is polled, never busy-spun: from
``busy_poll_s`` backing off to ``active_poll_s`` while reads are in flight, every
``active_poll_s`` while peers may read from us (``set_serving``: blocks are held), every
``idle_poll_s`` otherwise. In UCX peer mode a READ completes only once its *target* makes
progress, so the target's period adds to every read (measured on 2 cores: a 2 MiB read
took 1.2 ms longer with the target polling every 2 ms than every 0.5 ms; polling every
0.2 ms took enough CPU from the reader's copy to slow 64 MiB reads). NIXL's own progress
thread is off (it spins a full core per agent).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from kvxfer.errors import ErrorCode
from kvxfer.protocol import DigestItem, RankInfo, RegisterKV
from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.sidecar.nixl_extras import PeerExtras, host_extras
from kvxfer.sidecar.nixl_memory import Cleanup, Registrations
from kvxfer.sidecar.nixl_reads import Reads
from kvxfer.sidecar.nixl_staging import Arenas, Gathers, new_read, plan_gather
from kvxfer.sidecar.nixl_types import Event, NoticeReceived, PollPolicy, ReadRefused, TransferOptions
from kvxfer.sidecar.ownership import Creds, Holder
from kvxfer.sidecar.plan import ReadSpec
from kvxfer.sidecar.pool_server import PoolServer

log = logging.getLogger("kvxfer.transfer")

T = TypeVar("T")
_Command = tuple[Callable[[], Any], concurrent.futures.Future[Any]]


Spans = dict[int, tuple[int, int]]  # device (-1: host) -> (address, size) of its staging arena


def offered_staging(port: NixlPort) -> int:
    """What a Welcome offers: the size of an arena here (0: this sidecar stages nothing; with
    CUDA, once a VRAM rank's registration made its device's)."""
    vram = [size for dev, (_, size) in port.spans.items() if dev >= 0]
    return max(vram) if vram else port.spans.get(-1, (0, 0))[1]


def inline_ok(spec: ReadSpec, info: RankInfo, options: TransferOptions, reads: Reads) -> bool:
    """Whether the loop posts this read itself: a small one (``inline_bytes``), or a larger one
    (``inline_alone_bytes``) when nothing else waits for the loop and nothing is in flight; and
    never past the cap on chunks in flight."""
    bound = options.inline_bytes
    if spec.alone and not len(reads):
        bound = max(bound, options.inline_alone_bytes)
    return read_bound(spec, info) <= bound and not reads.full


def read_bound(spec: ReadSpec, info: RankInfo) -> int:
    """At most how many bytes a read moves into its local rank: its blocks times a block's
    bytes, or, when every plan names its regions (cut to some layers: a streamed receive's
    reads, ``layer_stream.restrict``), only those regions' share of a block. Decides which
    reads the loop posts itself: push mode's last read of one layer is small, its request not."""
    per_block = info.block_bytes()
    if spec.plans and all(p.num_regions and not p.state for p in spec.plans):
        n = info.layout.num_regions
        regions = info.regions[:n]
        cut = sum(regions[i].block_len for p in spec.plans
                  for i in range(p.local_region0, min(n, p.local_region0 + p.num_regions)))
        per_block = min(per_block, cut)
    return spec.num_blocks * per_block


class LoopEvents:
    """Delivers what the port reports to the handlers on the loop: from the NIXL thread, on
    the loop's next turn; from the loop itself (a read it posted), once the port let go of
    its lock (``deliver_here``, at the end of ``NixlPort.read``: the landing of a small read
    is handled before the call that posted it returns, not a loop turn later; the loop's
    next turn at the latest)."""

    def __init__(self) -> None:
        self.handlers: dict[type, Callable[[Any], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._here: list[tuple[Callable[[Any], None], Event]] = []

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._loop_thread = loop, threading.get_ident()

    def emit(self, event: Event) -> None:
        handler = self.handlers.get(type(event))
        if handler is None or self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._here.append((handler, event))
            self._loop.call_soon(self.deliver_here)
            return
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self._loop.call_soon_threadsafe(handler, event)

    def deliver_here(self) -> None:
        while self._here:
            handler, event = self._here.pop(0)
            try:
                handler(event)
            except Exception:  # (as the loop would: logged, the next event still delivered)
                log.exception("handling %s", type(event).__name__)

def run_queued(item: _Command | tuple[()], cmds: queue.SimpleQueue[_Command | None]) -> bool:
    """Run ``item`` (``()``: none) and every command queued behind it, each settling its
    future; False once told to stop (``None`` queued)."""
    while item:
        fn, fut = item
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
        try:
            nxt = cmds.get_nowait()
        except queue.Empty:
            nxt = ()
        if nxt is None:
            return False
        item = nxt
    return True


class NixlPort:
    def __init__(self, agent_name: str, options: TransferOptions, pools: PoolServer | None = None) -> None:
        self.agent_name = agent_name
        self.options = options
        self._pools = pools
        self._cmds: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # held by whichever thread is inside NIXL or the state below: the NIXL thread while
        # it runs commands and polls, the loop while it posts a small read itself
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="kvxfer-nixl", daemon=True)
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._agent: Any = None
        self._regs: Registrations | None = None
        self._reads: Reads | None = None
        self._extras: PeerExtras | None = None
        self._arenas: Arenas | None = None
        self.spans: Spans = {}  # the arenas', on the loop: set at start and after each registration
        self.events = LoopEvents()  # what the port reports, delivered on the loop
        self._emit = self.events.emit
        self.backends: list[str] = []
        self.reads_inline = 0  # reads planned and posted by the loop itself, ever
        self.poll = PollPolicy(options)
        # Test-only corruption hook (proves --verify-sample catches a wrong byte end to end):
        # the next N successful reads into host memory get one byte flipped after they land.
        self._corrupt_reads = int(os.environ.get("KVXFER_TEST_CORRUPT_READS", "0") or 0)

    # ------------------------------------------------------------------ life

    def on(self, kind: type[T], handler: Callable[[T], None]) -> None:
        """Call ``handler(event)`` on the loop for every event of this kind."""
        self.events.handlers[kind] = handler

    async def start(self) -> None:
        """Start the NIXL thread and create the agent (~0.5 s with UCX)."""
        self.events.attach(asyncio.get_running_loop())
        self._thread.start()
        await asyncio.wrap_future(self._ready)

    def stop(self, timeout: float = 5.0) -> None:
        """Fail what is in flight, unregister everything and end the thread (blocking)."""
        if self._thread.is_alive():
            self._cmds.put(None)
            self._thread.join(timeout)

    @property
    def counts(self) -> tuple[int, int, int]:  # (lists prepared, peer agents, devices without an arena)
        regs, arenas = self._regs, self._arenas  # (ints, for the metrics thread)
        return (regs.dlists_prepared, len(regs.peers), len(arenas.missing)) if regs and arenas else (0, 0, 0)

    def read_path(self) -> tuple[int, int, int]:  # (posted by the loop, landed in their post, fences), ever
        reads, extras = self._reads, self._extras  # (ints, for the metrics thread; Reads has a len)
        landed = reads.landed_in_post if reads is not None else 0
        return self.reads_inline, landed, extras.fences.posted if extras else 0

    # ------------------------------------------------------------------ commands

    async def register(self, key: Hashable, msg: RegisterKV, holder: Holder) -> RankInfo:
        """Map a rank's memory and register it (replacing the key's registration); ``holder``
        is the registering process (the memory it names must be provably its own)."""
        info, spans = await self._run(lambda: self._register(key, msg, holder.creds))
        self.spans.update(spans)  # (a VRAM rank's first registration on its device made its arena)
        return info

    async def unregister(self, key: Hashable) -> bool:
        """Its reads fail; its memory is released once they settled."""
        return await self._run(lambda: self._unregister(key))

    async def add_peer(self, name: str, metadata: bytes, ranks: list[RankInfo], reload: bool = False,
                       words_addr: int = 0) -> str:
        """Load a peer's agent metadata; a restarted peer has a new name (a per-process nonce), the
        same name is the same process (``reload``: new registrations; ``words_addr``: fences read it)."""
        return await self._run(lambda: self._add_peer(name, metadata, ranks, reload, words_addr))

    async def remove_peer(self, name: str, reason: str, stalled: bool = False) -> bool:
        """Its reads fail; its entry goes once they settled (``stalled``: at once, which ends
        a frozen target's READs in < 0.5 s with nothing landing after; benchmarks/frozen_peer.py)."""
        code = ErrorCode.PEER_STALLED if stalled else ErrorCode.PEER_DISCONNECTED
        return await self._run(lambda: self._remove_peer(name, reason, code, stalled))

    async def metadata(self) -> bytes:
        return await self._run(lambda: bytes(self._agent.get_agent_metadata()))

    async def read_word(self, agent: str, addr: int) -> tuple[int, int] | None:
        """One lease word of a peer, read now (None: it could not be read in time)."""
        return await self._run(lambda: self._reads_().read_word(agent, addr))

    async def cancel(self, req_id: str, code: str, reason: str) -> bool:
        """Fail a read in flight (it reports through ``ReadFinished`` once settled)."""
        return await self._run(lambda: self._reads_().cancel(req_id, code, reason))

    def notify_soon(self, agent: str, payload: bytes) -> None:
        """Send with no task or future: here if the NIXL thread idles with nothing queued, else
        queued; a fence follows it (``nixl_fences``: the next read from that peer lands in its post)."""
        extras: PeerExtras = self._extras  # type: ignore[assignment]  # (made with the agent)
        if self._here():
            try:
                extras.fences.notify(agent, payload)
            finally:
                self._lock.release()
            if len(extras.fences):
                self._wake()  # (the NIXL thread polls the fence)
        else:
            self._submit(lambda: extras.fences.notify(agent, payload))

    async def digest(self, key: Hashable, items: list[DigestItem], region0: int = 0,
                     num_regions: int = 0) -> str:
        return await self._run(lambda: self._regs_().digest(key, items, region0, num_regions))

    async def gather(self, ranks: list[tuple[Hashable, Any]], blocks: list[int], offset: int,
                     nbytes: int, device: int = -1) -> None:
        """Copy runs of held ``blocks`` into the slot at ``offset`` of ``device``'s arena (``Gathers``)."""
        running = await self._run(lambda: self._gathers.start(plan_gather(
            self._regs_().local, self._arenas, device, ranks, blocks, offset, nbytes)))
        if running is not None:
            await asyncio.wrap_future(running)

    def read(self, spec: ReadSpec) -> None:
        """Start a read; a ``ReadFinished`` reports its end. A small one is planned, posted and
        (CMA copies inside the call) finished right here, any other on the NIXL thread. One
        that cannot start raises here (inline) or is reported as a ``ReadRefused``."""
        if self._read_inline(spec):
            self.events.deliver_here()  # (its landing, reported before this call returns: no loop turn)
            return
        fut = self._submit(lambda: self._start_read(spec))

        def refused(f: concurrent.futures.Future[Any]) -> None:  # (on the NIXL thread)
            err = None if f.cancelled() else f.exception()
            if err is not None:
                self._emit(ReadRefused(spec.req_id, err))

        fut.add_done_callback(refused)

    def expect_reads(self) -> None:
        """A peer claimed held blocks: its READ is about to start (``PollPolicy.expect``)."""
        if self.poll.expect(time.monotonic()):
            self._wake()

    def set_serving(self, serving: bool) -> None:
        """Blocks are (or no longer are) held for peers to read: poll at the active period."""
        if self.poll.serve(serving):
            self._wake()

    # ------------------------------------------------------------------ loop <-> thread

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return fut

    def _wake(self) -> None:
        """Make the NIXL thread look now, not at the end of its poll period."""
        self._submit(lambda: None)

    def _regs_(self) -> Registrations:
        assert self._regs is not None, "NIXL not started"
        return self._regs

    def _reads_(self) -> Reads:
        assert self._reads is not None, "NIXL not started"
        return self._reads

    def _here(self) -> bool:
        """The loop may call NIXL now (holding the lock: release it): no command is queued (the
        loop's, the gather copier's: they run first) and the NIXL thread runs, outside NIXL."""
        return self._thread.is_alive() and self._cmds.empty() and self._lock.acquire(blocking=False)

    def _read_inline(self, spec: ReadSpec) -> bool:
        """Post a small read here (False, nothing done, unless _here(), small and under the cap)."""
        if self.options.inline_bytes <= 0 or spec.staged is not None or not self._here():
            return False
        try:
            regs, reads = self._regs_(), self._reads_()
            local = regs.local.get(spec.local_rank)
            if local is None or not inline_ok(spec, local.info, self.options, reads):
                return False
            self._start_read(spec)
            self.reads_inline += 1
            pending = reads.post_now(spec.req_id)
        finally:
            self._lock.release()
        if pending:
            self._wake()
        return True

    # ------------------------------------------------------------------ thread side

    def _register(self, key: Hashable, msg: RegisterKV, peer: Creds) -> tuple[RankInfo, Spans]:
        if key in self._regs_().local:
            self._unregister(key)
        info = self._regs_().register(key, msg, peer)
        return info, self._arenas.for_rank(info)  # type: ignore[union-attr]  # (made with the agent)

    def _unregister(self, key: Hashable) -> bool:
        regs = self._regs_()
        if key not in regs.local:
            return False
        settling = self._reads_().fail_where(lambda r: r.local_rank == key, ErrorCode.NOT_REGISTERED,
                                             "local memory unregistered during the read")
        regs.unregister(key, settling | self._gathers.pinned(key))  # (its memory outlives its gathers)
        return True

    def _add_peer(self, name: str, metadata: bytes, ranks: list[RankInfo], reload: bool, words: int) -> str:
        if name in self._regs_().peers:
            # Not "disconnected": the loop would drop the peer it is handshaking right now.
            self._remove_peer(name, "peer metadata replaced", ErrorCode.TRANSFER_ERROR)
        added = self._regs_().add_peer(name, metadata, ranks, reload)
        self._extras.loaded(name, metadata, words)  # type: ignore[union-attr]  # (made with the agent)
        return added

    def _remove_peer(self, name: str, reason: str, code: str, at_once: bool = False) -> bool:
        settling = self._reads_().fail_where(lambda r: r.peer == name, code, reason)
        self._extras.unloaded(name)  # type: ignore[union-attr]
        return self._regs_().remove_peer(name, settling, at_once)

    def _start_read(self, spec: ReadSpec) -> None:
        """Plan a read and queue it for posting (``started_notice`` goes to the peer once the
        chunks the cap allows are posted, from the posting thread: a round trip through the
        loop would compete with the copy for the GIL and the CPU)."""
        marks = [("nixl_thread", time.monotonic_ns())] if spec.trace else None
        corrupt = self._corrupt_reads > 0
        rd = new_read(self._regs_(), self._arenas, spec, self.options, marks, corrupt)
        self._corrupt_reads -= 1 if rd.corrupt_at else 0
        if marks is not None:
            marks.append(("planned_descs", time.monotonic_ns()))
        self._reads_().add(rd)

    def _create_agent(self) -> None:
        self._agent = create_agent(self.agent_name, self.options.ucx_error_mode, self.options.num_threads)
        cleanup = Cleanup()
        self._regs = Registrations(self._agent, self._pools, cleanup)
        self._extras, self._arenas = host_extras(self._agent, self.options, self.agent_name)
        self._reads = Reads(self._agent, self.options, self._emit, cleanup, self._extras.scratch,
                            self._extras.fences)
        self._gathers = Gathers(cleanup, self._submit)
        self.spans.update(self._arenas.spans())
        self.backends = ["UCX"]

    def _main(self) -> None:
        try:
            self._create_agent()
        except BaseException as e:
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        delay = self.options.idle_poll_s
        while True:
            try:
                item = self._cmds.get(timeout=delay) if delay > 0 else self._cmds.get_nowait()
            except queue.Empty:
                item = ()
            if item is None:
                break
            with self._lock:
                ran = bool(item)
                if not run_queued(item, self._cmds):
                    self._shutdown()
                    return
                try:
                    progressed = self._pump() or ran  # (a read posted inline: poll it soon)
                except Exception:
                    log.exception("NIXL progress failed")
                    progressed = False
            busy = len(self._reads_()) + len(self._extras.fences)  # type: ignore[union-attr]
            delay = self.poll.next_delay(time.monotonic(), delay, progressed, busy)
        with self._lock:
            self._shutdown()

    def _pump(self) -> bool:
        progressed = self._reads_().pump()
        self._extras.fences.poll()  # type: ignore[union-attr]
        return self._notices() or progressed

    def _notices(self) -> bool:
        """Progress the agent; emit the notifications that arrived."""
        notes = [(str(a), bytes(m)) for a, msgs in self._agent.get_new_notifs().items() for m in msgs]
        for agent_name, payload in notes:
            self._emit(NoticeReceived(agent_name, payload))
        return bool(notes)

    def _shutdown(self) -> None:
        regs, reads = self._regs_(), self._reads_()
        self._gathers.close()
        reads.fail_where(lambda r: True, ErrorCode.DRAINING, "sidecar shutting down")
        for name in list(regs.peers):
            self._remove_peer(name, "sidecar shutting down", ErrorCode.PEER_DISCONNECTED)
        for key in list(regs.local):
            self._unregister(key)
        if self._arenas is not None:
            self._arenas.close()
        if self._extras is not None:
            self._extras.close()
        # Keep progressing briefly so notifications already sent leave the process.
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            self._agent.get_new_notifs()
            time.sleep(0.002)

