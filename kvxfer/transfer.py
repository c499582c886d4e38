"""NIXL, owned by one dedicated thread: agent, registrations, peers, in-flight reads.

A CMA ``transfer()`` copies synchronously inside the call (~150 ms per GiB), so the
asyncio loop submits closures with ``TransferEngine.call`` (a concurrent Future comes back)
and receives events (``ReadFinished``, ``NoticeReceived``) through the callback it passed
in, which this thread schedules onto the loop with ``call_soon_threadsafe``. The one
exception is the hot path: a read of at most ``inline_bytes`` is planned and posted by the
loop itself (``read_now``), which saves the hand-off and the poll that sees it land. NIXL
calls from the two threads never overlap: each holds ``_lock`` while in NIXL (the loop
only tries it, and hands the read over when the NIXL thread has it), and the agent runs
NIXL's strict synchronization, under which its UCX workers are SERIALIZED (any thread,
one at a time).

Reads are split into chunks of at most ``chunk_bytes`` and posted round-robin across
requests with a cap on chunks in flight, so a 2 GiB request cannot delay a 2 MiB one by
seconds. Progress (transfer states, notifications) is polled, never busy-spun: from
``busy_poll_s`` backing off to ``active_poll_s`` while reads are in flight, every
``active_poll_s`` while peers may read from us (``serving``: blocks are held), every
``idle_poll_s`` otherwise. In UCX peer mode a READ completes only once its *target* makes
progress, so the target's period adds to every read (measured on 2 cores: a 2 MiB read
took 1.2 ms longer with the target polling every 2 ms than every 0.5 ms; polling every
0.2 ms took enough CPU from the reader's copy to slow 64 MiB reads). NIXL's own progress
thread is off (it spins a full core per agent).

Handle lifetimes are guarded: a handle is forgotten the moment it is released
(``transfer()`` on a released handle segfaults), and a handle that refuses release is
parked and retried, never reused.

A failed read is reported only once nothing can still write into its blocks. Releasing a
handle whose GETs are in flight does not stop the data: UCX cancels the requests, but
responses the peer already queued still land (measured over TCP: after a 2 s link cut, the
rest of a 120 MiB read arrived in blocks the engine had already reused). So at a deadline,
a cancel or a chunk's error the read stops posting and *settles*: its in-flight chunks are
polled until each is DONE or ERR, then released, then the failure goes out. A peer removed
meanwhile keeps its NIXL connection and descriptor lists until its reads settled. A read
that does not settle within ``settle_timeout_s`` is reported as ``ReadStuck``: the sidecar
then exits, because only the death of the process that owns the endpoints guarantees that
no late write lands (the connector sees the restart and fails the loads).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.integrity import digest, region_view
from kvxfer.protocol import DigestItem, KVLayout, RankInfo, RegisterKV, RemoteRegion
from kvxfer.sidecar.mapping import Mapping, map_memory
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger(__name__)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


@dataclass(frozen=True)
class TransferOptions:
    ucx_error_mode: str = "peer"  # "peer" surfaces remote failures on RDMA; "none" is faster on CMA
    num_threads: int = 0  # UCX backend worker threads (0: copy inside transfer())
    chunk_bytes: int = 64 << 20  # largest single NIXL request posted at once
    max_inflight_chunks: int = 8
    merge_runs: bool = True  # consecutive blocks as one descriptor per run (merge_runs)
    busy_poll_s: float = 50e-6  # first back-off step while reads are in flight
    active_poll_s: float = 5e-4  # longest step while reads are in flight or peers may read
    idle_poll_s: float = 2e-3  # poll period when nothing is in flight (notification latency)
    cuda: bool = False  # VRAM over CUDA IPC expected: UCX memtype cache off
    settle_timeout_s: float = 20.0  # a failed read's in-flight chunks must stop by then
    expect_read_s: float = 2e-3  # after a claim, poll at busy_poll_s this long (expect_reads)
    inline_bytes: int = 4 << 20  # reads up to this size are posted by the caller itself (read_now)


@dataclass(frozen=True)
class ReadFinished:
    req_id: str
    peer: str
    ok: bool
    nbytes: int
    seconds: float
    code: str = ""
    reason: str = ""
    descriptors: int = 0
    trace: tuple[tuple[str, int], ...] = ()  # the NIXL thread's hops (traced reads only)


@dataclass(frozen=True)
class ReadStuck:
    """A failed read whose chunks still run after settle_timeout_s: no way to stop them."""

    req_id: str
    peer: str
    seconds: float


@dataclass(frozen=True)
class NoticeReceived:
    agent: str
    payload: bytes


Event = ReadFinished | NoticeReceived | ReadStuck
_Command = tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]


@dataclass
class _LocalRank:
    key: Hashable  # kvxfer.registry.RankKey: the registry is the only caller of t_register
    layout: KVLayout
    mappings: list[Mapping]
    reg_descs: list[Any]
    info: RankInfo  # absolute region addresses, as peers see them

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in all its regions (an upper bound on what a block moves)."""
        return sum(r.block_len for r in self.info.regions)


@dataclass
class _Peer:
    name: str
    ranks: dict[tuple[str, int, int], RankInfo]  # by (engine, pp, tp): RankInfo.key


@dataclass
class _PairLists:
    """Prepared descriptor lists for one (peer, local rank, remote rank) plan.

    ``rows[q]`` are the dlist rows sub-position q reads (one per run of a block: a plan's
    segment in a region, or several of them merged where they touch on both sides); a
    descriptor index is ``row * num_blocks + block``.
    """

    local: Any
    remote: Any
    rows: list[np.ndarray]  # per q: row ids
    # by row id: [addr, block_len (bytes the row moves per block), stride, device]
    local_rows: np.ndarray
    remote_rows: np.ndarray
    local_mem: str
    remote_mem: str


@dataclass
class _Leg:
    """The part of a read that comes from one remote rank: descriptor indices into the
    prepared lists, or (``runs``) explicit [addr, len, device] rows once consecutive blocks
    were merged into runs (``merge_runs``)."""

    pair: _PairLists
    local_idx: np.ndarray
    remote_idx: np.ndarray
    next_desc: int = 0
    runs: tuple[np.ndarray, np.ndarray] | None = None
    chunk: int = 1  # descriptors per posted chunk

    @property
    def count(self) -> int:
        return len(self.runs[0]) if self.runs is not None else len(self.local_idx)


@dataclass
class _Deferred:
    waits_for: set[str]  # request ids still settling
    action: Callable[[], None]
    peer: str = ""  # set for a remote agent's removal (cancelled if that agent is re-added)


@dataclass
class _Read:
    req_id: str
    peer: str
    local_rank: Hashable  # the registry's RankKey
    legs: list[_Leg]
    nbytes: int
    deadline: float
    started: float = field(default_factory=time.monotonic)
    leg: int = 0  # the leg being posted
    handles: list[Any] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (code, reason) once failed; then it settles
    failed_at: float = 0.0
    stuck_reported: bool = False
    started_notice: bytes = b""  # sent to the peer once the first chunk is posted
    corrupt_at: int = 0  # test-only: a host address this read flips once it lands
    trace: list[tuple[str, int]] | None = None  # (hop, monotonic ns) when the receive is traced

    @property
    def all_posted(self) -> bool:
        return self.leg >= len(self.legs)

    @property
    def descriptors(self) -> int:
        return sum(leg.count for leg in self.legs)


def _error_code(exc: BaseException) -> str:
    name = type(exc).__name__
    if "RemoteDisconnect" in name:
        return ErrorCode.PEER_DISCONNECTED
    return ErrorCode.TRANSFER_ERROR


def strided_rows(regions: list[RemoteRegion], num_blocks: int) -> np.ndarray:
    """NIXL's strided N x 5 form: one row (addr, len, dev, stride, count) per region."""
    rows = np.empty((len(regions), 5), dtype=np.int64)
    for i, r in enumerate(regions):
        rows[i] = (r.addr, r.block_len, r.device_id, r.block_stride, num_blocks)
    return rows


def _geometry(rows: list[RemoteRegion]) -> np.ndarray:
    """``[addr, block_len, stride, device]`` per row."""
    return np.array([(r.addr, r.block_len, r.block_stride, r.device_id) for r in rows],
                    dtype=np.int64).reshape(-1, 4)


def desc_indices(rows: np.ndarray, num_blocks: int, block_ids: np.ndarray) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in every row, row-major (int32 for NIXL)."""
    return (rows.astype(np.int64)[:, None] * num_blocks + block_ids[None, :]).ravel().astype(np.int32)


def merge_rows(pairs: list[tuple[RemoteRegion, RemoteRegion]]) -> list[tuple[RemoteRegion, RemoteRegion]]:
    """Merge consecutive (local row, remote row) pairs that continue each other on both
    sides: row i ends where row i+1 starts, locally and remotely, with the same block
    strides and devices. Then every block's two runs are one, at every block index (both
    rows move by the same stride), so the merged row moves exactly their bytes. A
    block-outermost layout (vLLM's BLHNC/BLNHC: one block of all layers is one run) read
    between equal TP sizes becomes one row; a layer-outer one keeps one per region."""
    out: list[tuple[RemoteRegion, RemoteRegion]] = []
    for lr, rr in pairs:
        if out:
            pl, pr = out[-1]
            if (pl.addr + pl.block_len == lr.addr and pr.addr + pr.block_len == rr.addr
                    and pl.block_stride == lr.block_stride and pr.block_stride == rr.block_stride
                    and pl.device_id == lr.device_id and pr.device_id == rr.device_id
                    and pl.block_len + lr.block_len <= lr.block_stride
                    and pr.block_len + rr.block_len <= rr.block_stride):
                out[-1] = (msgspec.structs.replace(pl, block_len=pl.block_len + lr.block_len),
                           msgspec.structs.replace(pr, block_len=pr.block_len + rr.block_len))
                continue
        out.append((lr, rr))
    return out


# Merging consecutive blocks costs an un-prepared transfer (NIXL's initialize_xfer: ~50 us
# more than make_prepped_xfer, measured here) and saves ~2 us of transfer per descriptor
# it removes (32 KiB descriptors: 4.2 GB/s, 256 KiB and up: 5.4-5.6 GB/s, one transfer on
# this CPU); below this many descriptors saved, the prepared lists are used as they are.
MERGE_MIN_SAVED = 32


def merge_runs(local_rows: np.ndarray, remote_rows: np.ndarray, local_nb: int, remote_nb: int,
               li: np.ndarray, ri: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors ``li``/``ri`` (``row * num_blocks + block``, row geometry in
    ``*_rows[row] = (addr, block_len, stride, device)``) as [addr, len, device] rows where
    each run of consecutive descriptors that continue each other on both sides, in the same
    row, is one: a request whose consecutive local blocks map to consecutive remote blocks
    moves them in one descriptor per row where a block is contiguous with the next (a
    layer-outer region, or a block-outermost block of every layer). Runs never leave their
    row, so each stays inside the one registered memory its region lives in; a gap on either
    side ends a run."""
    lrow, lblk = np.divmod(li.astype(np.int64), local_nb)
    rrow, rblk = np.divmod(ri.astype(np.int64), remote_nb)
    lg, rg = local_rows[lrow], remote_rows[rrow]
    lstart = lg[:, 0] + lblk * lg[:, 2]
    rstart = rg[:, 0] + rblk * rg[:, 2]
    length = lg[:, 1]
    brk = np.ones(len(li), dtype=bool)
    brk[1:] = ((lrow[1:] != lrow[:-1]) | (rrow[1:] != rrow[:-1])
               | (lstart[1:] != lstart[:-1] + length[:-1]) | (rstart[1:] != rstart[:-1] + length[:-1]))
    first = np.flatnonzero(brk)
    lens = np.add.reduceat(length, first) if len(first) else length[:0]
    return (np.stack([lstart[first], lens, lg[first, 3]], axis=1),
            np.stack([rstart[first], lens, rg[first, 3]], axis=1))


def _leg_indices(
    pl: _PairLists,
    pairs: list[tuple[int, int, int]],
    lb: np.ndarray,
    rb: np.ndarray,
    local_nb: int,
    remote_nb: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Local and remote descriptor indices of one leg, and the bytes they move.

    Grouped by sub-position, then row, then block: contiguous blocks stay adjacent.
    """
    li_parts, ri_parts, nbytes = [], [], 0
    for q, rows in enumerate(pl.rows):
        sel = [(li, ri) for li, ri, qq in pairs if qq == q]
        if not sel:
            continue
        lblocks = lb[[a for a, _ in sel]]
        rblocks = rb[[b for _, b in sel]]
        li_parts.append(desc_indices(rows, local_nb, lblocks))
        ri_parts.append(desc_indices(rows, remote_nb, rblocks))
        nbytes += int(pl.local_rows[rows, 1].sum()) * len(sel)
    if not li_parts:
        return np.empty(0, np.int32), np.empty(0, np.int32), 0
    return np.concatenate(li_parts), np.concatenate(ri_parts), nbytes


def import_nixl() -> Any:
    """The NIXL Python API module from whichever single-variant wheel is installed.

    ``nixl_cu12`` / ``nixl_cu13`` import without torch; the ``nixl`` meta package drags
    torch in (2-3 s), so it is the last resort.
    """
    import importlib

    for module in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        return mod
    raise ImportError("no NIXL Python package found: pip install nixl-cu12 (or nixl-cu13)")


def create_agent(name: str, ucx_error_mode: str, num_threads: int) -> Any:
    """A NIXL agent with the UCX backend as the sidecar runs it: NIXL's progress thread off
    (it spins a full core), ``num_threads`` UCX worker threads, strict synchronization (the
    agent serializes calls into its backends, and UCX workers are created SERIALIZED: any
    thread may drive them, one at a time; TransferEngine.read_now relies on it)."""
    nixl = import_nixl()
    # (a NIXL without sync modes: with no progress thread its UCX workers are SERIALIZED too)
    sync = getattr(nixl, "nixl_thread_sync_t", None)
    extra = {"sync_mode": sync.NIXL_THREAD_SYNC_STRICT} if sync is not None else {}
    conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=num_threads, **extra)
    agent = nixl.nixl_agent(name, conf)
    params = {"ucx_error_handling_mode": ucx_error_mode}
    if num_threads > 0:
        params["num_threads"] = str(num_threads)
    agent.create_backend("UCX", params)
    return agent


class TransferEngine:
    """The NIXL agent and everything that touches it, on one thread."""

    def __init__(
        self, agent_name: str, options: TransferOptions, on_event: Callable[[Event], None]
    ) -> None:
        self.agent_name = agent_name
        self.options = options
        self._on_event = on_event
        self._cmds: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # held by whichever thread is inside NIXL or the state below: the NIXL thread while
        # it runs commands and polls, the loop while it posts a small read itself (read_now)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="kvxfer-nixl", daemon=True)
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._agent: Any = None
        self._local: dict[Hashable, _LocalRank] = {}  # NIXL registrations, by the registry's key
        self._pairs: dict[tuple[Any, ...], _PairLists] = {}  # (peer, local key, plan identity)
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[str, _Read] = {}
        self._post_queue: collections.deque[str] = collections.deque()
        self._inflight_chunks = 0
        self._zombies: list[Any] = []
        self._deferred: list[_Deferred] = []  # cleanup waiting for failed reads to settle
        self.backends: list[str] = []
        # counters, read from other threads (ints: assignment is atomic enough for stats)
        self.bytes_read = 0
        self.reads_ok = 0
        self.reads_failed = 0
        self.settled_late = 0  # failed reads reported only after in-flight chunks stopped
        self.pools: PoolServer | None = None  # the sidecar's memory channel (PoolMemory refs)
        self.dlists_prepared = 0  # descriptor list pairs prepared (prep_xfer_dlist), ever
        self.reads_inline = 0  # reads planned and posted by the caller itself (read_now), ever
        self.serving = False  # set by the loop while blocks are held for peers to read
        self._hot_until = 0.0  # poll at busy_poll_s until then (expect_reads)
        # Test-only corruption hook (proves --verify-sample catches a wrong byte end to end):
        # the next N successful reads into host memory get one byte flipped after they land.
        self._corrupt_reads = int(os.environ.get("KVXFER_TEST_CORRUPT_READS", "0") or 0)

    # ------------------------------------------------------------------ loop-side API

    def start(self) -> concurrent.futures.Future[None]:
        self._thread.start()
        return self._ready

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on the NIXL thread; fn is one of the ``t_*`` methods."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._cmds.put((fn, args, fut))
        return fut

    def read_now(self, req_id: str, peer: str, local_rank: Hashable, local_blocks: list[int],
                 remote_blocks: list[int], plans: list[RankPlan], pairing: BlockPairing, deadline_s: float,
                 started_notice: bytes = b"", remote_engine: str = "",
                 state_blocks: tuple[list[int], list[int]] = ([], []), trace: bool = False) -> bool:
        """Run a small read (``t_read``'s arguments) on the calling thread: plan it, post it
        and check it, with no hand-off to the NIXL thread and back. On one host a CMA
        ``transfer()`` copies inside the call, so a small read has landed when this returns
        (its ReadFinished is already on its way); one still in flight is polled by the NIXL
        thread as usual, which this wakes.

        Returns False, having done nothing, when the NIXL thread is inside NIXL right now
        (posting, polling) or has commands queued, when the read is larger than ``inline_bytes`` (the caller's
        thread would be held for the copy) or when the chunk cap is reached: then submit
        it with ``call(t_read, ...)``. Raises what ``t_read`` raises.

        NIXL is driven from two threads but never at once: every NIXL call is made under
        ``_lock``. The agent is created with NIXL's strict synchronization, so its UCX
        workers run in UCX's SERIALIZED thread mode (any thread, one at a time).
        """
        if self.options.inline_bytes <= 0 or not self._thread.is_alive():
            return False
        # Commands still queued (a registration, a peer's removal or reload) were submitted
        # first and must run first: this read then goes behind them. (Only the loop queues
        # commands, and the loop is here: none can arrive between this check and the post.)
        if not self._cmds.empty() or not self._lock.acquire(blocking=False):
            return False
        try:
            local = self._local.get(local_rank)
            blocks = len(local_blocks) + len(state_blocks[0])
            if (local is None or blocks * local.block_bytes > self.options.inline_bytes
                    or self._inflight_chunks >= self.options.max_inflight_chunks):
                return False
            self.t_read(req_id, peer, local_rank, local_blocks, remote_blocks, plans, pairing, deadline_s,
                        started_notice, remote_engine, state_blocks, trace)
            self.reads_inline += 1
            rd = self._reads[req_id]
            while not rd.all_posted and self._inflight_chunks < self.options.max_inflight_chunks:
                self._post_next(rd)
            if req_id in self._reads:
                self._check(rd, time.monotonic())
            pending = req_id in self._reads
        finally:
            self._lock.release()
        if pending:
            self._wake()
        return True

    def expect_reads(self) -> None:
        """A peer claimed held blocks: its READ is about to start, and in UCX peer mode a READ
        may complete only once its target (this agent) makes progress (measured here: every
        other READ after a NIXL notification waits for it). Poll at the busy period for
        ``expect_read_s``, starting now (in UCX's "none" mode READs need no target progress)."""
        if self.options.expect_read_s <= 0 or self.options.ucx_error_mode != "peer":
            return
        self._hot_until = time.monotonic() + self.options.expect_read_s
        self._wake()

    def _wake(self) -> None:
        """Make the NIXL thread look now, not at the end of its poll period."""
        self.call(lambda: None)

    def set_serving(self, serving: bool) -> None:
        """Blocks are (or no longer are) held for peers to read: poll at the active period."""
        if serving and not self.serving:
            self.serving = True
            self._wake()
        else:
            self.serving = serving

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._cmds.put(None)
            self._thread.join(timeout)

    # ------------------------------------------------------------------ thread-side commands

    def t_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def t_register(self, key: Hashable, msg: RegisterKV) -> RankInfo:
        """Map a rank's memory, register it with NIXL, prepare its local descriptor list.

        Returns what peers need to read from it (absolute region addresses).
        """
        layout = msg.layout
        if key in self._local:
            self.t_unregister(key)
        mappings: list[Mapping] = []
        regs: list[Any] = []
        agent = self._agent
        try:
            for ref in msg.memory:
                mappings.append(map_memory(ref, self.pools))
            mem_types = {m.mem_type for m in mappings}
            if len(mem_types) != 1:
                raise RequestError(ErrorCode.INVALID_LAYOUT, "mixed DRAM and VRAM in one rank")
            mem_type = mem_types.pop()
            for m in mappings:
                regs.append(agent.register_memory([(m.addr, m.size, m.device_id, "")], mem_type))
            remote = [
                RemoteRegion(
                    addr=mappings[r.memory].addr + r.offset,
                    block_len=r.block_len,
                    block_stride=r.block_stride,
                    device_id=mappings[r.memory].device_id,
                )
                for r in msg.regions
            ]
        except BaseException:
            for reg in regs:
                agent.deregister_memory(reg)
            for m in mappings:
                m.close()
            raise
        info = RankInfo(layout=layout, regions=remote, mem_type=mem_type)  # type: ignore[arg-type]
        self._local[key] = _LocalRank(key, layout, mappings, regs, info)
        return info

    def t_unregister(self, rank: Hashable) -> bool:
        local = self._local.get(rank)
        if local is None:
            return False
        for rd in [r for r in self._reads.values() if r.local_rank == rank]:
            self._fail(rd, ErrorCode.NOT_REGISTERED, "local memory unregistered during the read")
        del self._local[rank]
        pairs = self._take_pairs(lambda key: key[1] == rank)

        def release() -> None:
            self._release_pairs(pairs)
            for reg in local.reg_descs:
                self._agent.deregister_memory(reg)
            for m in local.mappings:
                m.close()

        self._after_settled({r.req_id for r in self._reads.values() if r.local_rank == rank}, release)
        return True

    def t_add_peer(self, name: str, metadata: bytes, ranks: list[RankInfo], reload: bool = False) -> str:
        """Load a peer's agent metadata; descriptor lists are prepared per plan on first use.

        Agent names carry a per-process nonce, so a restarted peer arrives under a new
        name; the same name again means the same process re-handshaked: reload it.
        """
        agent = self._agent
        if name in self._peers:
            # Not "disconnected": the loop would drop the peer it is handshaking right now.
            self.t_remove_peer(name, "peer metadata replaced", ErrorCode.TRANSFER_ERROR)
        if reload and any(d.peer == name for d in self._deferred):
            # Its registrations changed (new memory, new keys): the new metadata must be
            # loaded, which NIXL allows only once the old entry is removed, and that waits
            # until the reads against it settled. Refuse this time; the next request retries.
            raise RequestError(ErrorCode.TRANSFER_ERROR, f"peer {name} re-registered while reads of its "
                               "old registrations still settle; try again")
        if any(d.peer == name for d in self._deferred):
            # The same process again, still loaded while reads of its old entry settle:
            # keep it loaded (its old descriptor lists are still released later).
            self._deferred = [d for d in self._deferred if d.peer != name]
            self._peers[name] = _Peer(name, {info.key: info for info in ranks})
            return name
        raw = agent.add_remote_agent(metadata)
        loaded = raw.decode() if isinstance(raw, bytes) else str(raw)
        if loaded != name:
            agent.remove_remote_agent(loaded)
            raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                               f"peer metadata names agent {loaded!r}, its handshake said {name!r}")
        self._peers[name] = _Peer(name, {info.key: info for info in ranks})
        return name

    def t_remove_peer(self, name: str, reason: str, code: str = ErrorCode.PEER_DISCONNECTED) -> bool:
        peer = self._peers.pop(name, None)
        for rd in [r for r in self._reads.values() if r.peer == name]:
            self._fail(rd, code, reason)
        pairs = self._take_pairs(lambda key: key[0] == name)
        settling = {r.req_id for r in self._reads.values() if r.peer == name}
        self._after_settled(settling, lambda: self._release_pairs(pairs))

        def forget() -> None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # unknown to NIXL already
                log.debug("remove_remote_agent(%s): %s", name, e)

        self._after_settled(settling, forget, peer=name)
        return peer is not None

    def _after_settled(self, req_ids: set[str], action: Callable[[], None], peer: str = "") -> None:
        """Run ``action`` once none of ``req_ids`` has a chunk in flight (now, if none has)."""
        if req_ids:
            self._deferred.append(_Deferred(set(req_ids), action, peer))
        else:
            action()

    def _run_deferred(self, settled: str) -> None:
        keep = []
        for d in self._deferred:
            d.waits_for.discard(settled)
            if d.waits_for:
                keep.append(d)
            else:
                try:
                    d.action()
                except Exception:
                    log.exception("deferred NIXL cleanup failed")
        self._deferred = keep

    def t_read(
        self,
        req_id: str,
        peer: str,
        local_rank: Hashable,
        local_blocks: list[int],
        remote_blocks: list[int],
        plans: list[RankPlan],
        pairing: BlockPairing,
        deadline_s: float,
        started_notice: bytes = b"",
        remote_engine: str = "",
        state_blocks: tuple[list[int], list[int]] = ([], []),
        trace: bool = False,
    ) -> None:
        """Queue a READ (one leg per remote rank); a ReadFinished event reports the end.

        ``started_notice`` goes to the peer right after the first chunk is posted, from
        this thread: a round trip through the event loop would compete with the copy for
        the GIL and the CPU.
        """
        marks = [("nixl_thread", time.monotonic_ns())] if trace else None
        local = self._local[local_rank]
        pairs = pairing.pairs(len(local_blocks), len(remote_blocks))
        lb = np.asarray(local_blocks, dtype=np.int64)
        rb = np.asarray(remote_blocks, dtype=np.int64)
        # state blocks (Mamba/GDN) pair one to one and move only in the state regions
        sl, sr = state_blocks
        spairs = [(i, i, 0) for i in range(len(sl))]
        slb = np.asarray(sl, dtype=np.int64)
        srb = np.asarray(sr, dtype=np.int64)
        legs = []
        nbytes = 0
        for plan in plans:
            pl = self._pair_lists(peer, local, plan, remote_engine)
            remote_info = self._peers[peer].ranks[(remote_engine, plan.remote_pp, plan.remote_rank)]
            remote_nb = remote_info.layout.num_blocks
            if plan.state:
                li, ri, n = _leg_indices(pl, spairs, slb, srb, local.layout.num_blocks, remote_nb)
            else:
                li, ri, n = _leg_indices(pl, pairs, lb, rb, local.layout.num_blocks, remote_nb)
            if not len(li):
                continue
            leg = _Leg(pl, li, ri)
            # (runs never leave their row: a leg of one block has nothing to merge)
            blocks = len(sl) if plan.state else len(pairs)
            if self.options.merge_runs and blocks > 1 and len(li) > MERGE_MIN_SAVED:
                runs = merge_runs(pl.local_rows, pl.remote_rows, local.layout.num_blocks, remote_nb, li, ri)
                if len(li) - len(runs[0]) >= MERGE_MIN_SAVED:
                    leg.runs = runs
            largest = int((leg.runs[0] if leg.runs is not None else pl.local_rows)[:, 1].max())
            leg.chunk = max(1, self.options.chunk_bytes // largest)
            legs.append(leg)
            nbytes += n
        corrupt_at = 0
        target = next((p for p in plans if (sl if p.state else local_blocks)), None)
        if self._corrupt_reads > 0 and target is not None and local.info.mem_type == "DRAM":
            self._corrupt_reads -= 1
            reg = local.info.regions[target.local_region0]
            seg = next(q[0] for q in target.segments if q)
            first = sl[0] if target.state else local_blocks[pairs[0][0]]
            corrupt_at = reg.addr + first * reg.block_stride + seg.local_off
        self._reads[req_id] = _Read(
            req_id=req_id,
            peer=peer,
            local_rank=local_rank,
            legs=legs,
            nbytes=nbytes,
            deadline=time.monotonic() + deadline_s,
            started_notice=started_notice,
            corrupt_at=corrupt_at,
            trace=marks,
        )
        if marks is not None:
            marks.append(("planned_descs", time.monotonic_ns()))
        self._post_queue.append(req_id)

    def _pair_lists(self, peer: str, local: _LocalRank, plan: RankPlan, remote_engine: str) -> _PairLists:
        key = (peer, local.key, remote_engine, plan.remote_pp, plan.remote_rank, plan.local_region0,
               plan.remote_region0, plan.num_regions)
        pl = self._pairs.get(key)
        if pl is not None:
            return pl
        remote = self._peers[peer].ranks[(remote_engine, plan.remote_pp, plan.remote_rank)]
        lslice, rslice = plan.region_slices(len(local.info.regions))
        if lslice.stop > len(local.info.regions) or rslice.stop > len(remote.regions):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"plan reads regions {rslice} of "
                               f"{len(remote.regions)} into {lslice} of {len(local.info.regions)}")
        lregs = [local.info.regions[i] for i in lslice]
        rregs = [remote.regions[i] for i in rslice]
        lrows: list[RemoteRegion] = []
        rrows: list[RemoteRegion] = []
        rows: list[np.ndarray] = []
        for segs in plan.segments:
            runs = [(RemoteRegion(addr=lreg.addr + s.local_off, block_len=s.length,
                                  block_stride=lreg.block_stride, device_id=lreg.device_id),
                     RemoteRegion(addr=rreg.addr + s.remote_off, block_len=s.length,
                                  block_stride=rreg.block_stride, device_id=rreg.device_id))
                    for lreg, rreg in zip(lregs, rregs, strict=True) for s in segs]
            # (with fewer than 2 blocks on a side, two touching regions could be two
            # registrations side by side in memory: a merged row must stay inside one)
            merged = merge_rows(runs) if min(local.layout.num_blocks, remote.layout.num_blocks) > 1 else runs
            rows.append(np.arange(len(lrows), len(lrows) + len(merged), dtype=np.int64))
            lrows += [lr for lr, _ in merged]
            rrows += [rr for _, rr in merged]
        agent = self._agent
        self.dlists_prepared += 1  # read by a metrics gauge: a hostile peer must never get here
        ldl = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", strided_rows(lrows, local.layout.num_blocks), local.info.mem_type
        )
        try:
            rdl = agent.prep_xfer_dlist(peer, strided_rows(rrows, remote.layout.num_blocks), remote.mem_type)
        except Exception:
            agent.release_dlist_handle(ldl)
            raise
        pl = _PairLists(ldl, rdl, rows, _geometry(lrows), _geometry(rrows), local.info.mem_type,
                        remote.mem_type)
        self._pairs[key] = pl
        return pl

    def _take_pairs(self, match: Callable[[tuple[Any, ...]], bool]) -> list[_PairLists]:
        return [self._pairs.pop(key) for key in [k for k in self._pairs if match(k)]]

    def _release_pairs(self, pairs: list[_PairLists]) -> None:
        for pl in pairs:
            for handle in (pl.local, pl.remote):
                try:
                    self._agent.release_dlist_handle(handle)
                except Exception as e:
                    log.debug("release_dlist_handle: %s", e)

    def t_cancel(self, req_id: str, code: str, reason: str) -> bool:
        rd = self._reads.get(req_id)
        if rd is None:
            return False
        self._fail(rd, code, reason)
        return True

    def t_digest(self, rank: Hashable, items: list[DigestItem], region0: int = 0,
                 num_regions: int = 0) -> str:
        """Digest of these blocks and runs of a local rank's regions ``[region0, +num_regions)``
        (0: all; ``kvxfer.integrity``). Runs on this thread, which owns the mappings: an
        unregister cannot unmap them underneath."""
        local = self._local.get(rank)
        if local is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank {rank} not registered")
        nb = local.layout.num_blocks
        for item in items:
            if any(b >= nb for b in item.blocks):
                raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE, f"digest of blocks outside [0, {nb})")
        regions = local.info.regions
        stop = region0 + (num_regions or len(regions))
        if stop > len(regions):
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"digest of regions up to {stop} of {len(regions)}")
        views = []
        for reg in regions[region0:stop]:
            if any(off + n > reg.block_len for item in items for off, n in item.runs):
                raise RequestError(ErrorCode.INVALID_LAYOUT, "digest run outside a block")
            m = next(m for m in local.mappings if m.addr <= reg.addr < m.addr + m.size)
            views.append(region_view(m.as_tensor(), m.addr, reg.addr, nb, reg.block_len,
                                     reg.block_stride))
        return digest(views, items)

    def t_send_notice(self, peer: str, payload: bytes) -> None:
        self._agent.send_notif(peer, payload)

    def t_stats(self) -> dict[str, int]:
        return {
            "reads_in_flight": len(self._reads),
            "chunks_in_flight": self._inflight_chunks,
            "peers": len(self._peers),
            "local_ranks": len(self._local),
            "settling": sum(1 for r in self._reads.values() if r.failure is not None),
            "settled_late": self.settled_late,
            "dlists_prepared": self.dlists_prepared,
            "reads_inline": self.reads_inline,
        }

    # ------------------------------------------------------------------ thread internals

    def _create_agent(self) -> None:
        if self.options.cuda:
            # UCX's memtype cache only knows allocations it saw being made; IPC-imported
            # VRAM is classified as host and registration fails. Must be set before UCX init.
            os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
        self._agent = create_agent(self.agent_name, self.options.ucx_error_mode, self.options.num_threads)
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
                while item:
                    fn, args, fut = item
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(*args))
                        except BaseException as e:
                            fut.set_exception(e)
                    try:
                        item = self._cmds.get_nowait()
                    except queue.Empty:
                        item = ()
                    if item is None:
                        self._shutdown()
                        return
                try:
                    progressed = self._pump() or ran  # (a read posted by read_now: poll it soon)
                except Exception:
                    log.exception("NIXL progress failed")
                    progressed = False
            if time.monotonic() < self._hot_until:
                delay = self.options.busy_poll_s
            elif self._reads:
                delay = (self.options.busy_poll_s if progressed
                         else min(delay * 2, self.options.active_poll_s))
            elif self.serving:
                delay = self.options.active_poll_s
            else:
                delay = self.options.idle_poll_s
        with self._lock:
            self._shutdown()

    def _pump(self) -> bool:
        progressed = self._post_chunks()
        now = time.monotonic()
        for rd in list(self._reads.values()):
            progressed |= self._check(rd, now)
        if self._zombies:
            self._retry_zombies()
        notifs = self._agent.get_new_notifs()
        for agent_name, msgs in notifs.items():
            for payload in msgs:
                progressed = True
                self._on_event(NoticeReceived(str(agent_name), bytes(payload)))
        return progressed

    def _post_chunks(self) -> bool:
        posted = False
        while self._post_queue and self._inflight_chunks < self.options.max_inflight_chunks:
            req_id = self._post_queue.popleft()
            rd = self._reads.get(req_id)
            if rd is None or rd.all_posted:
                continue
            posted = True
            self._post_next(rd)
            if not rd.all_posted:
                self._post_queue.append(req_id)
        return posted

    def _post_next(self, rd: _Read) -> None:
        """Post the read's next chunk (a failure fails the read: nothing more is posted)."""
        if time.monotonic() > rd.deadline:
            # e.g. this process was stopped (SIGSTOP, a frozen cgroup) past the deadline: the
            # engine may have given up on these blocks already, so no chunk is posted late
            self._fail(rd, ErrorCode.DEADLINE, f"not posted by its deadline ({rd.leg} legs posted)")
            return
        agent = self._agent
        leg = rd.legs[rd.leg]
        lo = leg.next_desc
        hi = min(lo + leg.chunk, leg.count)
        try:
            if leg.runs is None:
                handle = agent.make_prepped_xfer(
                    "READ", leg.pair.local, leg.local_idx[lo:hi], leg.pair.remote, leg.remote_idx[lo:hi]
                )
            else:
                handle = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(leg.runs[0][lo:hi], leg.pair.local_mem),
                    agent.get_xfer_descs(leg.runs[1][lo:hi], leg.pair.remote_mem), rd.peer)
        except Exception as e:
            self._fail(rd, _error_code(e), f"prepare: {e}")
            return
        leg.next_desc = hi
        if hi >= leg.count:
            rd.leg += 1
        rd.handles.append(handle)
        self._inflight_chunks += 1
        try:
            state = agent.transfer(handle)
        except Exception as e:
            self._fail(rd, _error_code(e), f"post: {e}")
            return
        if state == "ERR":
            self._fail(rd, ErrorCode.TRANSFER_ERROR, "post returned ERR")
            return
        if rd.trace is not None and len(rd.trace) == 2:  # the first chunk
            rd.trace.append(("posted", time.monotonic_ns()))
        if rd.started_notice:
            notice, rd.started_notice = rd.started_notice, b""
            try:
                agent.send_notif(rd.peer, notice)
            except Exception as e:  # the read itself reports a dead peer
                log.warning("read-started notice for %s to %s not sent: %s", rd.req_id, rd.peer, e)

    def _check(self, rd: _Read, now: float) -> bool:
        if rd.failure is not None:
            return self._settle(rd, now)
        agent = self._agent
        progressed = False
        for handle in list(rd.handles):
            try:
                state = agent.check_xfer_state(handle)
            except Exception as e:
                self._fail(rd, _error_code(e), str(e))
                return True
            if state == "DONE":
                rd.handles.remove(handle)
                self._inflight_chunks -= 1
                self._release(handle)
                progressed = True
            elif state == "ERR":
                self._fail(rd, ErrorCode.TRANSFER_ERROR, "transfer state ERR")
                return True
        if rd.all_posted and not rd.handles:
            if rd.corrupt_at:
                import ctypes

                ctypes.c_uint8.from_address(rd.corrupt_at).value ^= 0xFF
                log.warning("test hook: flipped one byte of read %s after it landed", rd.req_id)
            del self._reads[rd.req_id]
            self.reads_ok += 1
            self.bytes_read += rd.nbytes
            trace = () if rd.trace is None else (*rd.trace, ("landed", time.monotonic_ns()))
            self._on_event(
                ReadFinished(rd.req_id, rd.peer, True, rd.nbytes, now - rd.started,
                             descriptors=rd.descriptors, trace=trace)
            )
            return True
        if now > rd.deadline:
            self._fail(rd, ErrorCode.DEADLINE, f"not finished after {now - rd.started:.3f}s")
            return True
        return progressed

    def _fail(self, rd: _Read, code: str, reason: str) -> None:
        """Stop posting; report the failure once no chunk of the read can write any more."""
        if rd.req_id not in self._reads or rd.failure is not None:
            return
        rd.failure = (code, reason)
        rd.failed_at = time.monotonic()
        rd.leg = len(rd.legs)  # nothing more is posted
        self._settle(rd, rd.failed_at)

    def _settle(self, rd: _Read, now: float) -> bool:
        progressed = False
        for handle in list(rd.handles):
            if self._state(handle) in ("DONE", "ERR"):  # terminal: nothing more lands
                rd.handles.remove(handle)
                self._inflight_chunks -= 1
                self._release(handle)
                progressed = True
        if rd.handles:
            if now - rd.failed_at > self.options.settle_timeout_s and not rd.stuck_reported:
                rd.stuck_reported = True
                self._on_event(ReadStuck(rd.req_id, rd.peer, now - rd.failed_at))
            return progressed
        del self._reads[rd.req_id]
        self.reads_failed += 1
        assert rd.failure is not None  # only failed reads settle
        code, reason = rd.failure
        waited = now - rd.failed_at
        if waited > 0.05:
            reason = f"{reason} (its in-flight chunks stopped {waited:.2f}s later)"
            self.settled_late += 1
        self._on_event(ReadFinished(rd.req_id, rd.peer, False, 0, now - rd.started, code, reason))
        if self._deferred:
            self._run_deferred(rd.req_id)
        return True

    def _state(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # still active in the backend: park it, never touch it again
            log.debug("xfer handle release deferred: %s", e)
            self._zombies.append(handle)

    def _retry_zombies(self) -> None:
        parked, self._zombies = self._zombies, []
        for handle in parked:
            self._release(handle)

    def _shutdown(self) -> None:
        for rd in list(self._reads.values()):
            self._fail(rd, ErrorCode.DRAINING, "sidecar shutting down")
        for name in list(self._peers):
            self.t_remove_peer(name, "sidecar shutting down")
        for rank in list(self._local):
            self.t_unregister(rank)
        # Keep progressing briefly so notifications already sent leave the process.
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            self._agent.get_new_notifs()
            time.sleep(0.002)
